"""`python -m analysis.mechanism`: how much does routing volatility corrupt my gradient? (issue 58)

Replays RL training steps on a Qwen3-MoE model (the tiny random-init model at each `--depths` number of MoE layers,
or `--model DIR`, a transformers checkpoint, at its own depth) and measures, per method (GRPO's token ratio, GSPO's
sequence ratio, GRPO+R2, GRPO+R3, token TIS), per staleness index k (the mini-batch update of the rollout), response
length and dial dose: the variance of the token and sequence log-ratios, the clipped token and sequence fractions,
experts changed per layer, the gradient error due to routing (relative error and cosine against the same loss with
the routing change removed) and the gradient's SNR across mini-batches (`analysis.mechanism_step`).

Writes `mechanism.jsonl` (one row per setting, k and method) and `mechanism.md` (per method the means over settings,
and the scaling exponents of the routing-induced gradient error and the log-ratio variances against response length
and MoE depth: statsmodels OLS of log(metric) on log(L) and log(depth) over the rows with k >= 1, 95% CI clustered by
seed, the unit of replication), both written to a temporary file and renamed. Experiment 5's pre-registered tests
on these rows: `python -m analysis.mechanism_tests`.

    python -m analysis.mechanism --out reports/mechanism --depths 2,4,8 --lengths 16,32,64,128 --doses 0,0.1,0.4
    python -m analysis.mechanism --model /path/to/qwen3_moe_checkpoint --lengths 64,256 --out my_mechanism

The policy state: the given checkpoint's, or the tiny models' at initialisation, or (`--states init,steps:100,...`)
the tiny models trained to each state by the project's trainer (`analysis.mechanism_states`). `--warm-steps` warms
the measurement's own Adam first (a fresh Adam's first step is a sign step on every weight).

    python -m analysis.mechanism --out reports/mechanism_states --depths 2 --lengths 9,16 --states init,steps:150,steps:300
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from analysis.mechanism_states import StateError, parse_states, state_checkpoint
from analysis.mechanism_step import METHODS, StepSetting, measure_step

EXPONENT_METRICS = ("grad_err_routing", "token_logratio_var", "seq_logratio_mean_var", "experts_changed")


def _numbers(kind):
    def parse(text: str):
        try:
            vals = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers, e.g. 16,32") from None
        if not vals:
            raise argparse.ArgumentTypeError("give at least one value")
        return vals
    return parse


def build_model(depth: int | None, model_dir: str | None, *, seed: int, max_positions: int):
    """(model, vocabulary size, depth): the tiny random-init Qwen3-MoE with `depth` MoE layers after one dense
    layer, or the checkpoint at `model_dir` in fp32."""
    import torch

    if model_dir is not None:
        from transformers import AutoModelForCausalLM

        from moe_gspo.rollout.hf_router_hooks import find_routers

        if not Path(model_dir).is_dir():
            raise ValueError(f"--model {model_dir!r} is not a directory; give a transformers checkpoint directory")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        routers = find_routers(model)
        if not routers:
            raise ValueError(f"--model {model_dir!r} has no MoE router; the measurement needs a Qwen3-MoE model")
        return model, int(model.config.vocab_size), len(routers)
    from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config(num_hidden_layers=depth + 1, mlp_only_layers=[0],
                                max_position_embeddings=max(256, max_positions))
    return build_tiny_model(cfg, seed=seed), int(cfg.vocab_size), depth


def _policy(depth, model_dir, state, s: StepSetting, out: Path | None, label: str, extra, progress):
    """(model, vocab, depth, the state's row fields): the checkpoint, the tiny model at its initialisation, or the
    tiny model trained to `state` on the task at `s.length` (`analysis.mechanism_states`)."""
    max_positions = (s.length + 2 if s.task else s.prompt_len) + s.length
    if state is None or state.steps == 0:
        model, vocab, d = build_model(depth, model_dir, seed=s.seed, max_positions=max_positions)
        return model, vocab, d, {"state": label if state is None else state.name, "state_steps": 0 if state else None}
    path, info = state_checkpoint(out, state, depth=depth, length=s.length, seed=s.seed, task=s.task,
                                  extra=extra, progress=progress)
    model, vocab, d = build_model(None, str(path), seed=s.seed, max_positions=max_positions)
    return model, vocab, d, {"state": state.name, "state_steps": state.steps,
                             "state_reward_last10": info["reward_last10"], "state_entropy_last10": info["entropy_last10"]}


def run_grid(*, depths, lengths, doses, seeds, base: StepSetting, model_dir: str | None = None,
             methods=tuple(METHODS), warm_steps=(0,), states=None, out: Path | None = None, state_label: str = "init",
             state_overrides: tuple[str, ...] = (), progress=None) -> list[dict]:
    """Rows of every (depth, seed, state, warm steps, length, dose) setting; each setting starts from a fresh copy
    of its model. `states` (tiny models only, `base.task` set): the policy states, trained checkpoints cached
    under `out`; else the policy is the checkpoint's or the tiny model's initialisation, labelled `state_label`."""
    import torch

    if states and (model_dir or not base.task or out is None):
        raise ValueError("--states trains the tiny models on a task: not with --model (measure each of your "
                         "checkpoints with --model and --state-label)")
    rows = []
    for depth in ([None] if model_dir else depths):
        for seed in seeds:
            for state, warm, length, dose in itertools.product(states or [None], warm_steps, lengths, doses):
                s = replace(base, length=length, dose=dose, seed=seed, warm_steps=warm)
                model, vocab, d, fields = _policy(depth, model_dir, state, s, out, state_label, state_overrides,
                                                  progress)
                torch.manual_seed(seed)
                for r in measure_step(model, s, vocab=vocab, methods=methods):
                    rows.append({"depth": d, **fields, **r})
                if progress:
                    progress(f"depth {d} state {fields['state']} warm steps {warm} length {length} dose {dose} "
                             f"seed {seed}: done")
    return rows


def exponents(rows: list[dict]) -> list[dict]:
    """Per method and metric: the OLS slopes of log(metric) on log(length) and log(depth) (each when it varies), with
    dose, k and seed effects, over the rows with k >= 1 and a positive finite metric (statsmodels). The seed is the
    unit of replication (rows of one seed share a model and a rollout): with >= 2 seeds the 95% CI is cluster-robust
    by seed (t with seeds - 1 df); with one seed there is no valid CI (lo, hi nan). Experiment 5's tests are per
    seed (`analysis.mechanism_tests`)."""
    import pandas as pd
    import statsmodels.formula.api as smf

    df = pd.DataFrame([r for r in rows if r["k"] >= 1])
    out = []
    if df.empty:
        return out
    for method in sorted(df["method"].unique()):
        for metric in EXPONENT_METRICS:
            cols = ["length", "depth", "dose", "k", "seed", metric] + [c for c in ("warm_steps", "state") if c in df]
            d = df[(df["method"] == method)][cols].copy()
            d = d[np.isfinite(d[metric].astype(float)) & (d[metric].astype(float) > 0)]
            terms = [t for t in ("length", "depth") if d[t].nunique() > 1]
            if not terms or len(d) <= len(terms) + 1:
                continue
            d["y"] = np.log(d[metric].astype(float))
            for t in terms:
                d[f"log_{t}"] = np.log(d[t])
            effects = [f" + C({c})" for c in ("dose", "k", "warm_steps", "state", "seed") if c in d and d[c].nunique() > 1]
            formula = "y ~ " + " + ".join(f"log_{t}" for t in terms) + "".join(effects)
            clusters = d["seed"].nunique()
            if clusters > 1:
                res = smf.ols(formula, data=d).fit(cov_type="cluster", use_t=True,
                                                   cov_kwds={"groups": d["seed"].astype(int).to_numpy()})
                ci = res.conf_int()
            else:
                res, ci = smf.ols(formula, data=d).fit(), None
            for t in terms:
                name = f"log_{t}"
                lo, hi = (float(ci.loc[name, 0]), float(ci.loc[name, 1])) if ci is not None else (math.nan, math.nan)
                out.append({"method": method, "metric": metric, "against": t, "exponent": float(res.params[name]),
                            "lo": lo, "hi": hi, "n": int(res.nobs), "seeds": int(clusters)})
    return out


def page(rows: list[dict], fits: list[dict]) -> str:
    import pandas as pd

    df = pd.DataFrame(rows)
    keys = ["token_logratio_var", "seq_logratio_sum_var", "seq_logratio_mean_var", "clipped_token_frac",
            "clipped_seq_frac", "experts_changed", "grad_err_routing", "grad_cos_routing"]
    lines = ["# How much does routing volatility corrupt the gradient?", "",
             f"Settings: depths {sorted(df['depth'].unique().tolist())}, lengths {sorted(df['length'].unique().tolist())}, "
             f"doses {sorted(df['dose'].unique().tolist())}, seeds {sorted(df['seed'].unique().tolist())}, warm-up "
             f"steps {sorted(df['warm_steps'].unique().tolist())}, "
             + (f"states {sorted(df['state'].unique().tolist())}, " if "state" in df else "")
             + f"{int(df['minibatches'].iloc[0])} mini-batches per rollout (`analysis.mechanism`; rows: mechanism.jsonl).",
             "", "### Per method, after the first update (k >= 1), mean over settings and k", "",
             "| method | " + " | ".join(keys) + " | SNR at k = 0 |", "|---" * (len(keys) + 2) + "|"]
    for method, g in df.groupby("method", sort=True):
        late = g[g["k"] >= 1]
        cells = [f"{late[k].mean():.3g}" if len(late) else "n/a" for k in keys]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {g[g['k'] == 0]['grad_snr'].mean():.3g} |")
    if "state" in df and df["state"].nunique() > 1:
        lines += state_tables(df)
    lines += ["", "### Scaling exponents (OLS of log(metric) on log(length) and log(depth), dose, k and seed effects; "
              "95% CI cluster-robust by seed, none from one seed)", ""]
    if fits:
        ci = lambda f: "n/a: one seed" if not math.isfinite(f["lo"]) else f"{f['lo']:+.2f}, {f['hi']:+.2f}"  # noqa: E731
        lines += ["| method | metric | against | exponent [95% CI] | rows | seeds |", "|---|---|---|---|---|---|"]
        lines += [f"| {f['method']} | {f['metric']} | {f['against']} | {f['exponent']:+.2f} [{ci(f)}] | {f['n']} | "
                  f"{f['seeds']} |" for f in fits]
    else:
        lines.append("Not fitted: length and depth do not vary, or too few rows.")
    return "\n".join(lines) + "\n"


STATE_KEYS = {"experts_changed": "experts changed", "token_logratio_var": "token log-ratio var",
              "clipped_token_frac": "clipped tokens", "grad_err_routing": "routing grad error"}


def state_tables(df) -> list[str]:
    """The policy-state axis, per warm-up W: each state's training reward and entropy (the trainer's last 10 steps)
    and what the measured step saw (its rollout's reward, k3 against the learner per dose, NLL per token); then per
    state and method the means after the first update (k >= 1) over doses, lengths and k, and the SNR at k = 0."""
    steps = lambda s: int(s.split(":")[1]) if s.startswith("steps:") and s[6:].isdigit() else -1  # noqa: E731
    order = sorted(df["state"].unique(), key=lambda s: (s != "init", steps(s), s))
    num = lambda v: "n/a" if v is None or v != v else f"{v:.3g}"  # noqa: E731
    doses = " / ".join(f"{p:g}" for p in sorted(df["dose"].unique()))
    lines = ["", "### By policy state (W: the measurement's warm-up steps before the measured one)", "",
             "| state | W | depth | length | training reward, last 10 steps | training entropy | measured rollout "
             f"reward | rollout k3 at doses {doses} | rollout NLL per token |", "|---" * 9 + "|"]
    for st in order:
        for (w, d, length), g in df[df["state"] == st].groupby(["warm_steps", "depth", "length"], sort=True):
            first = g.iloc[0]
            k3_col = "mismatch_k3" if "mismatch_k3" in g else "rollout_k3"  # rows written before the merge: rollout_k3
            k3 = " / ".join(num(v) for _, v in sorted(g.groupby("dose")[k3_col].mean().items()))
            lines.append(f"| {st} | {w} | {d} | {length} | {num(first.get('state_reward_last10'))} | "
                         f"{num(first.get('state_entropy_last10'))} | {num(g['reward_mean'].mean())} | {k3} | "
                         f"{num(g['rollout_nll_mean'].mean())} |")
    lines += ["", "| state | W | method | " + " | ".join(STATE_KEYS.values()) + " | SNR at k = 0 |",
              "|---" * (len(STATE_KEYS) + 4) + "|"]
    for st in order:
        for (w, method), g in df[df["state"] == st].groupby(["warm_steps", "method"], sort=True):
            late = g[g["k"] >= 1]
            lines.append(f"| {st} | {w} | {method} | " + " | ".join(num(late[k].mean()) for k in STATE_KEYS)
                         + f" | {num(g[g['k'] == 0]['grad_snr'].mean())} |")
    return lines


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


DEFAULT_GRID = (" The defaults are the tiny models' grid: depths 2,4,8 x lengths 16,32,64,128 x doses 0,0.1,0.4, 16 "
                "mini-batches, 5 warm-up steps (15.8 min wall on the shared 2-core box; reports/mechanism/).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.mechanism", description=__doc__.split("\n")[0] + DEFAULT_GRID)
    ap.add_argument("--out", required=True, help="folder for mechanism.jsonl and mechanism.md")
    ap.add_argument("--model", default=None, help="a transformers Qwen3-MoE checkpoint (default: the tiny models)")
    ap.add_argument("--depths", type=_numbers(int), default=[2, 4, 8], help="MoE layers of the tiny models")
    ap.add_argument("--lengths", type=_numbers(int), default=[16, 32, 64, 128], help="response tokens")
    ap.add_argument("--doses", type=_numbers(float), default=[0.0, 0.1, 0.4], help="dial flip probabilities")
    ap.add_argument("--seeds", type=_numbers(int), default=[0])
    ap.add_argument("--warm-steps", type=_numbers(int), default=[5],
                    help="the policy state: GRPO training steps before the measured one, e.g. 0,20,100 (0: a fresh "
                         "Adam's first update, a sign step on every weight)")
    ap.add_argument("--states", default=None,
                    help="policy states of the tiny models, e.g. init,steps:100,steps:300: each trained with "
                         "moe_gspo.train (configs/tiny_cpu.yaml) on --task at each depth and length, cached under "
                         "OUT/states/ and reused (default: the models as built, at initialisation)")
    ap.add_argument("--task", default="copy", help="with --states: the synthetic task (copy or reverse) whose "
                                                   "prompts the states train and are measured on")
    ap.add_argument("--state-overrides", default="",
                    help="with --states: more moe_gspo.train overrides, space-separated, e.g. 'algo.name=grpo "
                         "rollout.prompts_per_step=8' (part of the cache's identity)")
    ap.add_argument("--state-label", default=None,
                    help="without --states: the rows' state label (default: init, or checkpoint with --model)")
    ap.add_argument("--minibatches", type=int, default=16, help="N, updates per rollout (k = 0..N-1)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"some of {','.join(METHODS)}")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: the tiny models' passes are too small to share, and spinning "
                         "threads on a busy machine cost ~50x)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing mechanism.jsonl in --out")
    args = ap.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: {bad} unknown; use some of {','.join(METHODS)}")
    if any(w < 0 for w in args.warm_steps):
        ap.error("--warm-steps must be >= 0")
    if any(d < 1 for d in args.depths) or any(n < 1 for n in args.lengths):
        ap.error("--depths and --lengths must be >= 1")
    if any(not 0 <= p <= 1 for p in args.doses):
        ap.error("--doses must be flip probabilities in [0, 1]")
    try:
        states = parse_states(args.states) if args.states is not None else None
    except StateError as e:
        ap.error(str(e))
    if states and args.model:
        ap.error("--states trains the tiny models; with --model measure each of your checkpoints in its own call "
                 "with --state-label NAME")
    if states and args.task not in ("copy", "reverse"):
        ap.error(f"--task {args.task!r}: the states train on copy or reverse")
    if states and min(args.lengths) < 2:
        ap.error("--lengths must be >= 2 with --states (a symbol and EOS)")
    out = Path(args.out)
    if (out / "mechanism.jsonl").exists() and not args.overwrite:
        ap.error(f"{out / 'mechanism.jsonl'} exists; pass --overwrite to replace it or choose another --out")
    import torch

    if args.threads < 1:
        ap.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    base = StepSetting(minibatches=args.minibatches, groups=args.groups, group_size=args.group_size, lr=args.lr,
                       task=args.task if states else None)
    label = args.state_label or ("checkpoint" if args.model else "init")
    try:
        rows = run_grid(depths=args.depths, lengths=args.lengths, doses=args.doses, seeds=args.seeds, base=base,
                        model_dir=args.model, methods=methods, warm_steps=args.warm_steps, states=states, out=out,
                        state_label=label, state_overrides=tuple(shlex.split(args.state_overrides)), progress=lambda m: print(m, file=sys.stderr))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    _write(out / "mechanism.jsonl", "".join(json.dumps(r) + "\n" for r in clean))
    _write(out / "mechanism.md", page(rows, exponents(rows)))
    print(out / "mechanism.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
