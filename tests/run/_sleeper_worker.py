"""A torchrun worker that prints its pid and its launcher's, then sleeps; SIGTERM ends it as it ends
`moe_gspo.train` (one line, exit code 143). Used by tests/run/test_arm_parent_death.py and
tests/test_launch_blame.py."""
import os
import sys
import time

sys.path.insert(0, os.environ["MOE_GSPO_ROOT"])
from moe_gspo.run.activity import exit_with_launcher  # noqa: E402
from moe_gspo.run.errors import run_entry  # noqa: E402

exit_with_launcher()
print(f"worker {os.getpid()} launcher {os.getppid()}", flush=True)
sys.exit(run_entry(lambda: time.sleep(120)))
