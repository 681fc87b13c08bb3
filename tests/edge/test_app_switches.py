"""The edge's copy of the fabric's app switches: a read answered before a newer change
never undoes it."""

from __future__ import annotations

from omnifabric.edge.apps import Apps, follow


def enabled(apps: Apps) -> dict[str, bool]:
    return {a["app_id"]: a["enabled"] for a in apps.admin()["apps"]}


def test_newer_switches_win():
    apps = Apps()
    assert all(enabled(apps).values())
    apps.apply(["omni"], generation=2)
    assert not enabled(apps)["omni"] and not apps.enabled("video") and apps.enabled("audio")
    apps.apply([], generation=1)  # an older read arriving late: ignored
    assert not enabled(apps)["omni"]
    apps.apply(["audio_duplex", "not-in-the-catalog"], generation=3)
    assert enabled(apps)["omni"] and not apps.enabled("audio")
    assert [a["app_id"] for a in apps.public()["apps"]] == [
        "turnbased",
        "omni",
        "half_duplex_audio",
    ]
    assert apps.view("karaoke") is None and not apps.known("karaoke")


def test_a_restarted_scheduler_is_taken():
    apps = Apps()
    apps.apply(["omni"], generation=7, epoch="first")
    apps.apply([], generation=0, epoch="second")  # a new scheduler process: all on
    assert all(a["enabled"] for a in apps.admin()["apps"])
    apps.apply(["omni"], generation=1, epoch="second")
    apps.apply([], generation=0, epoch="second")  # late, of the same process: ignored
    assert not apps.enabled("video")


async def test_a_scheduler_that_started_afresh_is_given_the_switches_back():
    """follow(): a new scheduler process (restart or failover) that never had a switch
    is sent the apps that were off here; one that was switched since is taken as it is."""
    import asyncio

    from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb

    class Scheduler:
        def __init__(self, epoch: str) -> None:
            self.epoch, self.off, self.generation = epoch, set(), 0

        def switches(self):
            return scheduler_pb.AppSwitches(
                disabled_app_ids=sorted(self.off), generation=self.generation, epoch=self.epoch
            )

        async def GetApps(self, request, timeout):  # noqa: N802 - the stub's name
            return scheduler_pb.GetAppsResponse(switches=self.switches())

        async def SetApp(self, request, timeout):  # noqa: N802
            (self.off.discard if request.enabled else self.off.add)(request.app_id)
            self.generation += 1
            return scheduler_pb.SetAppResponse(switches=self.switches())

    apps = Apps()
    first = Scheduler("first")
    await apps.switch(first, "omni", False)
    fresh = Scheduler("second")
    follower = asyncio.ensure_future(follow(apps, fresh, interval_s=0.01))
    try:
        await asyncio.sleep(0.1)
        assert fresh.off == {"omni"} and not apps.enabled("video")
        # Switched on there by an operator (generation 1 on): taken, not undone.
        await fresh.SetApp(scheduler_pb.SetAppRequest(app_id="omni", enabled=True), 1)
        await asyncio.sleep(0.1)
        assert fresh.off == set() and apps.enabled("video")
    finally:
        follower.cancel()
