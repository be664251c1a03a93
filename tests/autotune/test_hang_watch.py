"""The tuner's hang watch on the CPU: GPU work that never finishes ends the process with a line naming the config
(exit status 3) instead of a tuner waiting forever; work that finishes in time leaves the process alone."""

import subprocess
import sys
import textwrap
import time

from tilekit.autotune.tuner import HUNG_EXIT


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_a_block_past_its_limit_ends_the_process_naming_what_hung():
    start = time.monotonic()
    done = _run("""
        import time
        from tilekit.autotune.tuner import hang_watch
        with hang_watch("config {'TM': 1, 'TK': 128} of quantize_fp8/K=4096", 0.5):
            time.sleep(30)
        print("not reached")
    """)
    assert done.returncode == HUNG_EXIT and time.monotonic() - start < 25
    assert "config {'TM': 1, 'TK': 128} of quantize_fp8/K=4096 has not finished in 0.5 s" in done.stderr
    assert "not reached" not in done.stdout


def test_a_block_that_finishes_in_time_leaves_the_process_alone():
    done = _run("""
        import time
        from tilekit.autotune.tuner import hang_watch
        with hang_watch("quick", 0.5):
            time.sleep(0.05)
        time.sleep(1.0)
        print("alive")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "alive", done.stderr


def test_the_agreement_check_watches_each_config_the_default_first():
    """A default config whose first run never returns is caught too (it runs before the others' loop)."""
    done = _run("""
        import time
        from tilekit.autotune import tuner
        tuner.HANG_S = 0.5
        class Case:
            def outputs(self, config):
                time.sleep(30)
        tuner.agreeing(Case(), [{"A": 1}, {"A": 2}], {"A": 1}, name="demo/M=1")
    """)
    assert done.returncode == HUNG_EXIT
    assert "config {'A': 1} (the default) of demo/M=1 has not finished" in done.stderr
