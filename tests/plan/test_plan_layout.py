"""The plan when the config's process layout does not work on the GPU count (issue 32, defect 5):
`python -m moe_gspo.plan configs/qwen3_30b_a3b.yaml --gpus 4` said `EDP=?` and "DOES NOT FIT (20.1 GiB to
spare)" (EP=8 and rollout TP=8 do not divide 4 GPUs) and suggested no layout for 4 GPUs."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from moe_gspo.config_load import load_config
from moe_gspo.plan import make_plan
from moe_gspo.plan.__main__ import main
from moe_gspo.plan.from_config import plan_for_config, resolve_hf_config, with_overrides
from moe_gspo.plan.knobs import valid_layouts
from moe_gspo.plan.memory import layout_problems
from moe_gspo.plan.params import Geometry

CFG30 = "configs/qwen3_30b_a3b.yaml"


def cfg(*overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(CFG30, list(overrides))


@pytest.fixture(scope="module")
def hf30():
    return resolve_hf_config(cfg())[0]


def overrides_of(knob: str) -> list[str]:
    return [o for o in knob.split("  (")[0].split() if "=" in o]


def test_four_gpus_names_the_layout_and_a_fix_that_fits(capsys, hf30):
    assert main([CFG30, "--gpus", "4", "--attention", "unfused"]) == 1
    out = capsys.readouterr().out
    peak = next(line for line in out.splitlines() if line.startswith("peak:"))
    assert "to spare" not in peak and "CANNOT RUN on 4 GPUs" in peak
    assert "parallel.expert_parallel_size=8" in peak and "rollout.tensor_parallel_size=8" in peak
    assert "EDP=?" not in out and "EDP=none (EDP = GPUs / EP, and EP=8 does not divide the 4 GPUs)" in out
    assert "parallel.expert_parallel_size=8 does not divide the 4 GPUs" in out
    assert "rollout.tensor_parallel_size=8 does not divide the 4 GPUs" in out
    knobs = out.split("knob to turn:\n")[1].split("notes:")[0].strip().splitlines()
    assert "parallel.expert_parallel_size=4" in knobs[0] and "rollout.tensor_parallel_size=4" in knobs[0]
    assert "none fits alone" in out  # 4 x 80 GiB: the valid layouts need one more knob, and it says so
    # the first suggestion, applied on 4 GPUs, fits
    fixed = plan_for_config(with_overrides(cfg(), overrides_of(knobs[0].lstrip("- "))), num_gpus=4, gpu_mem_gib=80,
                            hf_config=hf30, model_source="test", attention="unfused")
    assert fixed.fits and not fixed.layout_problems


def test_four_large_gpus_fit_with_the_layout_change_alone(hf30):
    res = make_plan(cfg(), num_gpus=4, gpu_mem_gib=141, attention="unfused")
    assert not res.fits and len(res.layout_problems) == 2
    assert overrides_of(res.knobs[0]) == ["parallel.expert_parallel_size=4", "rollout.tensor_parallel_size=4"]
    for knob in res.knobs:
        if knob.startswith("--gpus"):
            continue
        fixed = plan_for_config(with_overrides(cfg(), overrides_of(knob)), num_gpus=4, gpu_mem_gib=141,
                                hf_config=hf30, model_source="test", attention="unfused")
        assert fixed.fits, knob
    assert res.knobs[-1].startswith("--gpus 8")


@pytest.mark.parametrize("gpus,mem,extra,want", [
    (8, 80, [], r"FITS \(\d+\.\d GiB to spare\)"),
    (8, 40, [], r"DOES NOT FIT \(\d+\.\d GiB over\)"),
    (4, 80, [], r"CANNOT RUN on 4 GPUs: the process layout does not work there"),
    (16, 80, ["parallel.expert_parallel_size=3"], r"CANNOT RUN on 16 GPUs"),
    (8, 80, ["--host-mem-gib", "100"], r"DOES NOT FIT: not the peak but another limit"),
])
def test_a_failing_verdict_never_claims_memory_to_spare(capsys, gpus, mem, extra, want):
    argv = [CFG30, "--gpus", str(gpus), "--gpu-mem-gib", str(mem), "--attention", "unfused", *extra]
    code = main(argv)
    peak = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("peak:"))
    assert re.search(want, peak), peak
    assert (code == 0) == ("FITS" in peak)
    assert code == 0 or "to spare" not in peak


def test_json_lists_the_layout_problems(capsys):
    assert main([CFG30, "--gpus", "4", "--json", "--attention", "unfused"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and len(out["layout_problems"]) == 2
    assert set(out["layout_problems"]) <= set(out["problems"])
    assert out["knobs"][0].startswith("parallel.expert_parallel_size=4 rollout.tensor_parallel_size=4")


def test_layout_problems_and_valid_layouts(hf30):
    geom = Geometry.from_hf(hf30)  # 128 experts, 32 query heads, 4 KV heads
    assert layout_problems(geom, num_gpus=8, ep=8, tp=8) == []
    assert layout_problems(geom, num_gpus=6, ep=6, tp=1) == [
        "parallel.expert_parallel_size=6 does not divide the 128 experts (it must divide the GPU count and the "
        "number of experts)"]
    assert "does not divide the 6 GPUs nor the 32 query heads" in layout_problems(geom, num_gpus=6, ep=2, tp=12)[0]
    assert valid_layouts(cfg(), geom, num_gpus=8) == []  # the config's own layout works
    layouts = valid_layouts(cfg(), geom, num_gpus=4)
    assert layouts[0] == ["parallel.expert_parallel_size=4", "rollout.tensor_parallel_size=4"]
    assert len(layouts) == 9  # EP in {1, 2, 4} x TP in {1, 2, 4}
    # only the failing field changes; routes recorded by vLLM need rollout TP = 1
    assert valid_layouts(cfg("rollout.tensor_parallel_size=1", "rollout.record_routes=true"), geom, num_gpus=4) == [
        ["parallel.expert_parallel_size=4"], ["parallel.expert_parallel_size=2"], ["parallel.expert_parallel_size=1"]]
    assert valid_layouts(cfg("parallel.expert_parallel_size=2"), geom, num_gpus=4)[0] == [
        "rollout.tensor_parallel_size=4"]
