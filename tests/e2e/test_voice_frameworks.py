"""Voice-agent frameworks' OpenAI Realtime clients against the edge, unchanged, on a real
scheduler, synthetic worker and keyed edge on 127.0.0.1:

- LiveKit Agents' `livekit-plugins-openai` RealtimeModel. Its RealtimeSession (the part of an
  agent that speaks the protocol) runs without a LiveKit room: audio goes in as
  rtc.AudioFrames, and what the framework reports (its generation streams, events and
  metrics) is checked.
- Pipecat's OpenAIRealtimeLLMService in a pipeline of its own: audio goes in as
  InputAudioRawFrames, and the frames it pushes downstream are checked.

Each framework's tests skip where it is not installed (neither is one of omnifabric's
dependencies: `pip install livekit-agents livekit-plugins-openai` or
`pip install "pipecat-ai[openai]"` into the test environment to run them).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.conftest import scaled
from tests.e2e.test_default_voice import http_url
from tests.stack import keyed_stack

KEY = "sk-voice-framework"
RATE = 24000  # both frameworks' rate, in and out
FRAME = RATE // 10  # 100 ms frames, as a microphone track delivers them


# The frameworks: module fixtures, named before `stack` so that a missing one skips before
# any service starts.


@pytest.fixture(scope="module")
def livekit() -> SimpleNamespace:
    """LiveKit Agents and its OpenAI plugin."""
    pytest.importorskip("livekit.plugins.openai")
    from livekit import rtc
    from livekit.agents import llm
    from livekit.plugins import openai

    return SimpleNamespace(openai=openai, rtc=rtc, llm=llm)


@pytest.fixture(scope="module")
def pipecat() -> SimpleNamespace:
    """Pipecat and its OpenAI Realtime service."""
    pytest.importorskip("pipecat.services.openai.realtime.llm")
    from pipecat.frames import frames
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.task import PipelineParams
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.realtime import events
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
    from pipecat.workers.runner import WorkerRunner

    return SimpleNamespace(
        frames=frames,
        Pipeline=Pipeline,
        PipelineParams=PipelineParams,
        PipelineWorker=PipelineWorker,
        FrameProcessor=FrameProcessor,
        events=events,
        Service=OpenAIRealtimeLLMService,
        WorkerRunner=WorkerRunner,
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = keyed_stack(tmp_path_factory.mktemp("logs"), f"{KEY}\n")
    yield s
    s.stop()


def tone(seconds: float) -> list[bytes]:
    """A loud tone as PCM16 frames of FRAME samples (the synthetic engine hears speech)."""
    t = np.arange(int(seconds * RATE)) / RATE
    x = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()
    return [x[i : i + FRAME * 2] for i in range(0, len(x), FRAME * 2)]


async def until(condition, timeout_s: float = 30.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), scaled(timeout_s))


# LiveKit Agents


@dataclass
class Reply:
    """One generation as the framework hands it to an agent."""

    user_initiated: bool
    text: str = ""
    audio_samples: int = 0
    modalities: list[str] = field(default_factory=list)
    calls: list[Any] = field(default_factory=list)
    """The generation's function calls (llm.FunctionCall)."""


@dataclass
class Recorder:
    """A RealtimeSession's events, as an AgentSession would listen to them."""

    session: Any
    kinds: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    metrics: list[Any] = field(default_factory=list)
    replies: list[asyncio.Task] = field(default_factory=list)
    server_events: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        on = self.session.on
        on("input_speech_started", lambda _: self.kinds.append("input_speech_started"))
        on("input_speech_stopped", lambda _: self.kinds.append("input_speech_stopped"))
        on("generation_created", self._generation)
        on("error", self.errors.append)
        on("metrics_collected", self.metrics.append)
        on("openai_server_event_received", self.server_events.append)

    def _generation(self, generation) -> None:
        self.kinds.append("generation_created")
        self.replies.append(asyncio.ensure_future(read_generation(generation)))

    async def reply(self, timeout_s: float = 30.0) -> Reply:
        """The first generation, read to its end."""
        await until(lambda: self.replies, timeout_s)
        return await asyncio.wait_for(self.replies[0], scaled(timeout_s))

    async def response_done(self, timeout_s: float = 30.0) -> dict:
        def done() -> list[dict]:
            return [e for e in self.server_events if e["type"] == "response.done"]

        await until(done, timeout_s)
        return done()[0]


async def read_generation(generation) -> Reply:
    reply = Reply(user_initiated=generation.user_initiated)

    async def text(message) -> None:
        async for delta in message.text_stream:
            reply.text += str(delta)

    async def audio(message) -> None:
        async for frame in message.audio_stream:
            assert frame.sample_rate == RATE and frame.num_channels == 1
            reply.audio_samples += frame.samples_per_channel

    async for message in generation.message_stream:
        await asyncio.gather(text(message), audio(message))
        reply.modalities = list(await message.modalities)
    async for call in generation.function_stream:
        reply.calls.append(call)
    return reply


class LiveKitSession:
    """The plugin's model as an agent would make it, pointed at the edge, and one of its
    sessions (closed on exit)."""

    def __init__(self, livekit: SimpleNamespace, stack, **options: Any) -> None:
        self.livekit = livekit
        self.model = livekit.openai.realtime.RealtimeModel(
            base_url=http_url(stack.url, "/v1"), api_key=KEY, model="minicpm-o-4.5", **options
        )

    async def __aenter__(self) -> Recorder:
        self.session = self.model.session()
        return Recorder(self.session)

    async def __aexit__(self, *exc: object) -> None:
        await self.session.aclose()
        await self.model.aclose()

    async def speak(self, seconds: float = 2.0) -> None:
        """A tone pushed in real time, as a microphone track feeds an agent; then nothing
        (the edge's clock hears the silence)."""
        for chunk in tone(seconds):
            frame = self.livekit.rtc.AudioFrame(chunk, RATE, 1, len(chunk) // 2)
            self.session.push_audio(frame)
            await asyncio.sleep(FRAME / RATE)


def no_errors(errors: list) -> None:
    """The plugin's defaults ask for what no engine here does (a transcription model, an
    OpenAI voice, semantic_vad eagerness): the edge takes them and reports the settings in
    effect, never with an error."""
    assert not errors, errors


async def test_livekit_realtime_model_answers_a_spoken_turn(livekit, stack):
    lk = LiveKitSession(livekit, stack)  # the plugin's defaults, as an agent gets them
    async with lk as rec:
        await lk.speak()
        reply = await rec.reply()
        done = await rec.response_done()
        await asyncio.sleep(0.1)  # the metrics follow response.done
    assert rec.kinds[:3] == ["input_speech_started", "input_speech_stopped", "generation_created"]
    assert not reply.user_initiated  # the server's turn detection made it
    assert reply.modalities == ["audio", "text"]
    assert reply.audio_samples >= RATE  # over a second of 24 kHz speech
    assert reply.text.strip()  # the audio's transcript, streamed as the agent's text
    # the response's metrics (the plugin also reports the connection's, with no request id)
    [metrics] = [m for m in rec.metrics if m.request_id == done["response"]["id"]]
    assert not metrics.cancelled and metrics.output_tokens > 0
    no_errors(rec.errors)


async def test_livekit_generate_reply_answers_a_text_turn(livekit, stack):
    async with LiveKitSession(livekit, stack) as rec:
        chat = livekit.llm.ChatContext()
        chat.add_message(role="user", content="Say hello")
        await asyncio.wait_for(rec.session.update_chat_ctx(chat), scaled(10))
        created = await asyncio.wait_for(rec.session.generate_reply(), scaled(5))
        assert created.user_initiated
        reply = await rec.reply()
    assert "Say hello" in reply.text  # the synthetic engine echoes the turn
    assert reply.audio_samples > 0
    no_errors(rec.errors)


async def test_livekit_chat_context_holds_the_spoken_reply(livekit, stack):
    lk = LiveKitSession(livekit, stack)
    async with lk as rec:
        await lk.speak()
        reply = await rec.reply()
        await rec.response_done()
        items = [(i.role, i.content) for i in rec.session.chat_ctx.items if i.type == "message"]
    assert ("assistant", [reply.text]) in items, items


async def test_livekit_function_tool_is_called_and_its_result_answered(livekit, stack):
    """Issue 53: an agent's function tool reaches the engine, the model's call comes back
    on the generation's function stream with its arguments, and the tool's output, added
    to the chat context as an agent does, is what the next reply answers with."""
    import json

    @livekit.llm.function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: the city
        """
        return "cloudy and 14 degrees"

    async with LiveKitSession(livekit, stack) as rec:
        session = rec.session
        await asyncio.wait_for(session.update_tools([get_weather]), scaled(10))
        chat = livekit.llm.ChatContext()
        chat.add_message(role="user", content="What is the weather in Paris?")
        await asyncio.wait_for(session.update_chat_ctx(chat), scaled(10))
        await asyncio.wait_for(session.generate_reply(), scaled(10))
        calls = (await rec.reply()).calls
        assert [c.name for c in calls] == ["get_weather"], calls
        assert json.loads(calls[0].arguments) == {"city": "Paris"}
        chat = session.chat_ctx.copy()
        output = livekit.llm.FunctionCallOutput(
            call_id=calls[0].call_id, name="get_weather", output="cloudy and 14 degrees",
            is_error=False,
        )  # fmt: skip
        chat.items.append(output)
        await asyncio.wait_for(session.update_chat_ctx(chat), scaled(10))
        await asyncio.wait_for(session.generate_reply(), scaled(10))
        await until(lambda: len(rec.replies) > 1, 30)
        reply = await asyncio.wait_for(rec.replies[1], scaled(30))
    assert "cloudy and 14 degrees" in reply.text  # the synthetic engine says the output
    no_errors(rec.errors)


# Pipecat


class PipecatRun:
    """The service in a pipeline that ends in a recorder of the frames it pushes (run on
    enter, ended on exit)."""

    def __init__(self, pipecat: SimpleNamespace, stack, **settings: Any) -> None:
        self.pc = pipecat
        self.frames: list[Any] = []
        self.errors: list[Any] = []  # ErrorFrames go upstream, to the worker
        self.service = pipecat.Service(
            api_key=KEY,
            base_url=stack.url,
            settings=pipecat.Service.Settings(model="minicpm-o-4.5", **settings),
        )
        frames = self.frames

        class Recorder(pipecat.FrameProcessor):
            async def process_frame(self, frame, direction) -> None:
                await super().process_frame(frame, direction)
                frames.append(frame)
                await self.push_frame(frame, direction)

        params = pipecat.PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE)
        self.worker = pipecat.PipelineWorker(
            pipecat.Pipeline([self.service, Recorder()]), params=params, idle_timeout_secs=None
        )
        self.runner = pipecat.WorkerRunner(handle_sigint=False)

        @self.worker.event_handler("on_pipeline_error")
        async def on_pipeline_error(worker, frame) -> None:
            self.errors.append(frame)

    def of(self, name: str) -> list[Any]:
        return [f for f in self.frames if type(f).__name__ == name]

    def kinds(self) -> list[str]:
        """The frames' kinds in order, each run of one kind once."""
        kinds: list[str] = []
        for f in self.frames:
            if not kinds or kinds[-1] != type(f).__name__:
                kinds.append(type(f).__name__)
        return kinds

    async def __aenter__(self) -> PipecatRun:
        await self.runner.add_workers(self.worker)
        self.task = asyncio.ensure_future(self.runner.run())
        try:  # connected, and the session configured (or refused)
            await until(lambda: self.service._api_session_ready or self.errors, 10)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        """End the pipeline (the service closes its socket); cancel it if it will not end."""
        await self.worker.queue_frame(self.pc.frames.EndFrame())
        try:
            await asyncio.wait_for(asyncio.shield(self.task), scaled(10))
        except TimeoutError:
            await self.worker.cancel(reason="the test is over")
            await asyncio.wait_for(self.task, scaled(10))

    async def speak(self, seconds: float = 2.0) -> None:
        """A tone queued in real time, as a transport's microphone feeds the pipeline."""
        for chunk in tone(seconds):
            frame = self.pc.frames.InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1)
            await self.worker.queue_frame(frame)
            await asyncio.sleep(FRAME / RATE)

    async def reply(self, timeout_s: float = 30.0) -> None:
        """Until the service ends a response (or reports an error)."""
        await until(lambda: self.of("LLMFullResponseEndFrame") or self.errors, timeout_s)


async def test_pipecat_realtime_service_answers_a_spoken_turn(pipecat, stack):
    async with PipecatRun(pipecat, stack) as run:  # the service's defaults
        await run.speak()
        await run.reply()
    assert not run.errors, run.errors
    kinds = run.kinds()
    order = ["TTSStartedFrame", "TTSTextFrame", "TTSStoppedFrame", "LLMFullResponseEndFrame"]
    firsts = [kinds.index(k) for k in order]  # ValueError: one is missing
    assert firsts == sorted(firsts), kinds
    audio = run.of("TTSAudioRawFrame")
    assert {(f.sample_rate, f.num_channels) for f in audio} == {(RATE, 1)}
    assert sum(len(f.audio) for f in audio) >= RATE * 2  # over a second of PCM16
    assert "".join(f.text for f in run.of("TTSTextFrame")).strip()  # the reply's transcript


async def test_pipecat_reply_opens_with_a_full_response_start(pipecat, stack):
    async with PipecatRun(pipecat, stack) as run:
        await run.speak()
        await run.reply()
    kinds = run.kinds()
    assert kinds.index("LLMFullResponseStartFrame") < kinds.index("LLMFullResponseEndFrame")


async def test_pipecat_session_goes_on_past_a_setting_the_engine_does_not_use(pipecat, stack):
    ev = pipecat.events
    properties = ev.SessionProperties(
        audio=ev.AudioConfiguration(output=ev.AudioOutput(voice="alloy"))
    )
    async with PipecatRun(pipecat, stack, session_properties=properties) as run:
        await run.speak()
        await run.reply()
    assert not run.errors, run.errors
    assert run.of("LLMFullResponseEndFrame")
    assert sum(len(f.audio) for f in run.of("TTSAudioRawFrame")) >= RATE * 2


async def test_pipecat_function_is_called_and_its_result_answered(pipecat, stack):
    """Issue 53: a context with a tool, as an app gives one: the service asks the engine,
    the model's call runs the registered handler, its result goes back as the call's
    output, and the next response answers with it."""
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
    from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.frame_processor import FrameDirection

    weather = FunctionSchema(
        name="get_weather",
        description="Get the current weather in a city.",
        properties={"city": {"type": "string", "description": "the city"}},
        required=["city"],
    )
    asked: list[dict] = []

    async def get_weather(params) -> None:
        asked.append(dict(params.arguments))
        await params.result_callback({"conditions": "cloudy and 14 degrees"})

    async with PipecatRun(pipecat, stack) as run:
        run.service.register_function("get_weather", get_weather)
        context = LLMContext(
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=ToolsSchema(standard_tools=[weather]),
        )
        await run.worker.queue_frame(pipecat.frames.LLMContextFrame(context))
        await until(lambda: run.of("FunctionCallResultFrame") or run.errors, 30)
        assert asked == [{"city": "Paris"}], (asked, run.errors)
        # As the assistant aggregator asks once a result is in: answer what came back.
        await run.service.queue_frame(
            pipecat.frames.LLMContextFrame(context), FrameDirection.UPSTREAM
        )
        await until(lambda: len(run.of("LLMFullResponseEndFrame")) > 1 or run.errors, 30)
    assert not run.errors, run.errors
    said = "".join(f.text for f in run.of("TTSTextFrame"))
    assert "cloudy and 14 degrees" in said, said
