"""`python -m selfspec.training.draft_lora_cli train|eval|export`: the loop, the validation set, the CLI.

train: resumable (`--resume` continues from `<run-dir>/state.pt`, saved atomically every
`--save-minutes` and on SIGTERM / Ctrl-C / the end); one line per step on stdout; JSONL log
`<run-dir>/log.jsonl` with train lines (every `--log-every` steps) and validation lines (every
`--eval-every` steps: per-depth top-1 agreement, draft argmax == teacher argmax, on held-out
windows, split by block kind: "group" = B masks, "two_pass" = [clean token, B-1 masks]).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import time

import torch

from selfspec.training import draft_data
from selfspec.training.draft_lora import (Block, DraftParams, Frozen, Hyper, _drop, block_batch, block_logits,
                                          clean_pass, export, load_state, make_optimizer, save_state, train_step)

VAL_B = 12
RESUMABLE = ("p_chat", "p_greedy", "lr", "blocks", "p_root", "bmin", "bmax", "decay")


class Validation:
    """Held-out windows with their teacher argmax and clean K/V cached (the base never changes)."""

    def __init__(self, fz: Frozen, tok, window: int, blocks_per_kind: int = 6):
        self.items = []
        rng = random.Random(99)
        for kind, ids in draft_data.validation_windows(tok, window):
            w = torch.tensor(ids)
            tlog, kvs = clean_pass(fz, w)
            blocks = []
            for j in range(2 * blocks_per_kind):
                root = j % 2 == 1
                nm = VAL_B - 1 if root else VAL_B
                blocks.append(Block(rng.randint(8, window - nm), nm, root))
            self.items.append((kind, w, tlog.argmax(-1), kvs, blocks))

    @torch.no_grad()
    def __call__(self, fz: Frozen, params: DraftParams) -> dict:
        hits: dict[str, torch.Tensor] = {}
        counts: dict[str, torch.Tensor] = {}
        for kind, w, targmax, kvs, blocks in self.items:
            batch = block_batch(w, blocks, fz.mask_id)
            tgt, depth = batch[4], batch[5]
            pred = _drop(block_logits(fz, params, batch, kvs, w.shape[0]), fz.mask_id).argmax(-1)
            ok = (pred == targmax[tgt - 1]).float()
            root = torch.tensor([b.root for b in blocks for _ in range(b.n_mask)])
            for name, sel in ((f"{kind}/group", ~root), (f"{kind}/two_pass", root), ("all/group", ~root),
                              ("all/two_pass", root)):
                h = hits.setdefault(name, torch.zeros(VAL_B))
                c = counts.setdefault(name, torch.zeros(VAL_B))
                h.index_add_(0, depth[sel] - 1, ok[sel])
                c.index_add_(0, depth[sel] - 1, torch.ones(int(sel.sum())))
        return {k: [round(float(x), 4) for x in (hits[k] / counts[k].clamp(min=1))[: int((counts[k] > 0).sum())]]
                for k in sorted(hits)}


def _load(model_name: str):
    import selfspec

    model, tok = selfspec.load(model_name, draft_lora=False)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


def cmd_train(a) -> int:
    torch.set_num_threads(a.threads)
    os.makedirs(a.run_dir, exist_ok=True)
    state_path = os.path.join(a.run_dir, "state.pt")
    model, tok = _load(a.model)
    fz = Frozen(model)
    if os.path.exists(state_path):
        if not a.resume:
            raise SystemExit(f"{state_path} exists: pass --resume to continue it, or choose another --run-dir")
        params, opt, hp, step, counters = load_state(state_path, model)
        print(f"resumed at step {step} ({counters['positions']} positions seen)", flush=True)
        given = {k: getattr(a, k) for k in RESUMABLE if getattr(a, k, None) is not None}
        if given:  # a resumed run may change its data mix and learning rate, nothing that shapes the adapter
            hp = dataclasses.replace(hp, **given)
            for g in opt.param_groups:
                g["base_lr"] = hp.lr * (hp.emb_lr_mult if g is opt.param_groups[1] else 1.0)
            print(f"resumed with {given}", flush=True)
    else:
        hp = Hyper(**{k: getattr(a, k) for k in Hyper.__dataclass_fields__ if getattr(a, k, None) is not None})
        torch.manual_seed(hp.seed)
        params = DraftParams(model, hp.r, hp.alpha, seed=hp.seed)
        opt = make_optimizer(params, hp)
        step, counters = 0, {"tokens": 0, "positions": 0, "seconds": 0.0}
    if hp.p_greedy > 0:
        if not a.greedy_data:
            raise SystemExit("--p-greedy needs --greedy-data PATH (python -m selfspec.training.greedy_data)")
        print(f"{len(draft_data.greedy_records(a.greedy_data))} greedy-answer records in {a.greedy_data}", flush=True)
    val = Validation(fz, tok, hp.window)
    log = open(os.path.join(a.run_dir, "log.jsonl"), "a")

    def write(row):
        log.write(json.dumps(row) + "\n")
        log.flush()

    def evaluate():
        t0 = time.time()
        res = val(fz, params)
        write({"kind": "val", "step": step, **counters, "val_agree": res, "eval_seconds": round(time.time() - t0, 1)})
        print(f"[val] step {step}: group d1..d4 {res['all/group'][:4]}  two_pass d1..d4 {res['all/two_pass'][:4]}",
              flush=True)

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    if step == 0:
        evaluate()
    t_start, last_save, ema = time.time(), time.time(), None
    end_step = a.steps if a.steps else None
    try:
        while not stop["flag"]:
            if end_step is not None and step >= end_step:
                break
            if a.minutes and time.time() - t_start > a.minutes * 60:
                break
            t0 = time.time()
            ids, rng = draft_data.train_window(tok, hp.seed, step, hp.window, hp.p_chat, a.greedy_data, hp.p_greedy)
            window = torch.tensor(ids)
            loss, st = train_step(fz, params, opt, hp, step, window, rng)
            dt = time.time() - t0
            step += 1
            m = int(st["kl"].numel())
            counters["tokens"] += int(window.numel())
            counters["positions"] += m
            counters["seconds"] = round(counters["seconds"] + dt, 2)
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            d1 = float(st["agree"][st["depth"] == 1].mean())
            print(f"step {step} loss {loss:.4f} ema {ema:.4f} d1 {d1:.2f} agree {float(st['agree'].mean()):.3f} "
                  f"{dt:.2f} s/step {m / dt:.1f} pos/s", flush=True)
            if step % a.log_every == 0:
                write({"kind": "train", "step": step, **counters, "loss": round(loss, 5), "loss_ema": round(ema, 5),
                       "agree": round(float(st["agree"].mean()), 4), "d1": round(d1, 4), "grad_norm": round(st["grad_norm"], 4),
                       "s_per_step": round(dt, 3), "positions_per_s": round(m / dt, 2)})
            if step % a.eval_every == 0:
                evaluate()
            if time.time() - last_save > a.save_minutes * 60:
                save_state(state_path, params, opt, hp, step, counters)
                last_save = time.time()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    save_state(state_path, params, opt, hp, step, counters)
    print(f"saved step {step} -> {state_path}", flush=True)
    return 0


def _params_from(a, model):
    state_path = os.path.join(a.run_dir, "state.pt")
    if getattr(a, "init", False) or not os.path.exists(state_path):
        return DraftParams(model), {"step": 0}
    params, _, hp, step, counters = load_state(state_path, model)
    return params, {"step": step, **counters, "hyper": hp.__dict__}


def cmd_eval(a) -> int:
    torch.set_num_threads(a.threads)
    model, tok = _load(a.model)
    fz = Frozen(model)
    params, info = _params_from(a, model)
    res = Validation(fz, tok, a.window)(fz, params)
    print(json.dumps({"step": info["step"], "val_agree": res}, indent=1))
    return 0


def cmd_export(a) -> int:
    torch.set_num_threads(a.threads)
    model, _ = _load(a.model)
    params, info = _params_from(a, model)
    hp = info.get("hyper", {})
    note = (f"selfspec.training.draft_lora self-distillation, step {info['step']}, {info.get('positions', 0)} mask "
            f"positions, {info.get('tokens', 0)} window tokens; hyper {json.dumps(hp, sort_keys=True)}; "
            "draft rows only (q/k/v/o/gate/up/down + mask_embedding); docs/training.md")
    export(params, model, a.out, note, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    print(f"exported step {info['step']} -> {a.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m selfspec.training.draft_lora_cli")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "eval", "export"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="smollm2-135m-instruct")
        p.add_argument("--run-dir", default="runs/draft_lora")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--window", type=int, default=256)
    t = sub.choices["train"]
    t.add_argument("--resume", action="store_true",
                   help="continue <run-dir>/state.pt; these may change on resume: " + ", ".join(RESUMABLE))
    t.add_argument("--greedy-data", default=None,
                   help="JSONL of the model's own greedy answers (python -m selfspec.training.greedy_data); "
                        "--p-greedy of the windows come from it")
    t.add_argument("--minutes", type=float, default=0)
    t.add_argument("--steps", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=20)
    t.add_argument("--log-every", type=int, default=1)
    t.add_argument("--save-minutes", type=float, default=4)
    for k, v in Hyper().__dict__.items():
        if k != "window":
            t.add_argument("--" + k.replace("_", "-"), type=type(v), default=None)
    sub.choices["eval"].add_argument("--init", action="store_true", help="the untrained adapter (B = 0)")
    e = sub.choices["export"]
    e.add_argument("--out", default="models/smollm2-135m-instruct/linear_spec_lora")
    e.add_argument("--bf16", action="store_true")
    a = ap.parse_args(argv)
    return {"train": cmd_train, "eval": cmd_eval, "export": cmd_export}[a.cmd](a)


if __name__ == "__main__":
    raise SystemExit(main())
