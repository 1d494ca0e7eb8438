"""SIGINT and SIGTERM during a run (``ray_cluster_ft.cli._stop_on_signals``): an interrupt whose exception Python
ignored is delivered again, once, and never after the run or into the clean-up of a later one."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from ray_cluster_ft.cli import Interrupted, _stop_on_signals, main

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signal handlers are installed from the main thread only")


class SignalledWhileFinalized:
    """Raises SIGTERM in its ``__del__``: the handler's exception lands where Python only reports it ("Exception
    ignored"), as it did once in the suite during an import while a local Ray started."""

    def __del__(self):
        signal.raise_signal(signal.SIGTERM)


def _busy(seconds: float) -> None:
    """The main thread's own code, where a delivered interrupt is raised."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.001)


def test_a_sigterm_whose_exception_python_ignored_still_stops_the_run(tmp_path, capsys, monkeypatch):
    from ray_cluster_ft import pipeline

    def run_pipeline(*_, **__):
        SignalledWhileFinalized()
        _busy(2.0)
        raise AssertionError("the run went on after SIGTERM")

    monkeypatch.setattr(pipeline, "run_pipeline", run_pipeline)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"output:\n  dir: {tmp_path / 'run'}\n")
    hook, handler = sys.unraisablehook, signal.getsignal(signal.SIGTERM)
    assert main(["run", str(spec)]) == 143
    assert capsys.readouterr().err == ("ray-cluster-ft: interrupted (SIGTERM); continue the run with "
                                       f"`ray-cluster-ft run --resume {tmp_path / 'run'}`\n")
    assert sys.unraisablehook is hook and signal.getsignal(signal.SIGTERM) is handler  # both put back


def test_other_ignored_exceptions_still_reach_the_hook_before(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value)))

    class Broken:
        def __del__(self):
            raise ValueError("not an interrupt")

    with _stop_on_signals():
        Broken()
    assert seen == [ValueError]


def test_the_delivery_again_never_reaches_past_the_run_or_into_a_clean_up():
    got = []
    before = signal.signal(signal.SIGTERM, lambda signum, _: got.append(signum))
    try:
        # The run ends before the 50 ms: the caller's own handler must not get the signal afterwards.
        with _stop_on_signals():
            SignalledWhileFinalized()
        _busy(0.3)
        assert got == []
        # A second SIGTERM raised where it can be: the first one's delivery must not cut its clean-up short.
        events = []
        try:
            with _stop_on_signals():
                try:
                    SignalledWhileFinalized()
                    signal.raise_signal(signal.SIGTERM)
                except Interrupted:
                    _busy(0.3)
                    events.append("cleaned up")
        except Interrupted:  # a KeyboardInterrupt: let it fail this test, not stop the session
            pytest.fail("the first SIGTERM's delivery again cut the second one's clean-up short")
        assert events == ["cleaned up"] and got == []
    finally:
        signal.signal(signal.SIGTERM, before)
