"""The edge's copy of the fabric's app switches: a read answered before a newer change
never undoes it."""

from __future__ import annotations

from omnifabric.edge.apps import Apps


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
