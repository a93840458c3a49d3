"""A torchrun worker that prints its pid and its launcher's, then sleeps (tests/run/test_arm_parent_death.py)."""
import os
import sys
import time

sys.path.insert(0, os.environ["MOE_GSPO_ROOT"])
from moe_gspo.run.activity import exit_with_launcher  # noqa: E402

exit_with_launcher()
print(f"worker {os.getpid()} launcher {os.getppid()}", flush=True)
time.sleep(120)
