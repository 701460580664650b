"""Signals as Windows has them, simulated here: no SIGHUP, a SIGBREAK (Ctrl-Break, a closed console,
a sweep's stop), and a signal the system may refuse a handler for: a job still stops cleanly on the
signals there are."""
import signal

import pytest

import common
from common import on_stop_signals

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def test_without_sighup_and_refused_sigint_a_run_trains_and_stops_on_sigterm(tiny_cfg, monkeypatch, capsys):
    from training.checkpoint import latest_checkpoint, load_checkpoint
    from training.trainer import train
    real_signal, installed = signal.signal, []

    def refusing_sigint(signum, handler):
        if signum == signal.SIGINT and handler not in (signal.SIG_DFL, signal.SIG_IGN):
            raise ValueError("signal only works in main thread of the main interpreter")
        installed.append(signum)
        return real_signal(signum, handler)
    monkeypatch.delattr(signal, "SIGHUP", raising=False)
    monkeypatch.delattr(signal, "SIGBREAK", raising=False)
    monkeypatch.setattr(signal, "signal", refusing_sigint)

    def stop_at_3(step, model):
        if step == 3:
            signal.raise_signal(signal.SIGTERM)   # (os.kill would end the process on Windows)
    cfg = tiny_cfg(**{"train.max_steps": 100, "train.eval_interval": 100})
    summary = train(cfg, on_step=stop_at_3)
    assert summary["step"] == 3 and summary["exit_code"] == 128 + signal.SIGTERM, summary
    assert load_checkpoint(latest_checkpoint(cfg.out_dir))["step"] == 3
    assert set(installed) == {signal.SIGTERM}, "a handler for SIGTERM alone, and its previous one back"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert "stopped by SIGTERM at step 3, checkpoint saved in" in capsys.readouterr().out


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="SIGUSR1 stands in for SIGBREAK (POSIX only)")
def test_sigbreak_stops_a_job_where_the_system_has_it(monkeypatch):
    monkeypatch.setattr(signal, "SIGBREAK", signal.SIGUSR1, raising=False)
    assert signal.SIGUSR1 in common.stop_signals()
    got = []
    with on_stop_signals(got.append):
        signal.raise_signal(signal.SIGUSR1)
    assert got == [signal.SIGUSR1] and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
