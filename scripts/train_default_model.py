#!/usr/bin/env python3
"""Train the bundled default model (models/mamba2-tiny-pystdlib) from scratch.

A ~3.7 M-parameter Mamba2 language model trained on the running Python's standard library source,
with the tokenizer made by train_tokenizer.py. It exists so that a fresh clone can serve a real
checkpoint that writes recognisable (Python-like) text, with no download.

    python scripts/train_tokenizer.py --out models/mamba2-tiny-pystdlib
    python scripts/train_default_model.py --device cuda --max-minutes 6 --out models/mamba2-tiny-pystdlib

(the bundled checkpoint came from this, with --out on a scratch folder; see its README.md)

CPU smoke test (a few steps, small batch):

    python scripts/train_default_model.py --device cpu --steps 3 --batch-size 2 --seq-len 128 \
        --tokenizer models/mamba2-tiny-pystdlib --out /tmp/m

The output directory is an ordinary Hugging Face checkpoint (config.json, model.safetensors in
bfloat16, generation_config.json, tokenizer files) plus train_log.json with the loss curve.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# scripts/ is sys.path[0] when this file is run directly; share the corpus definition with the
# tokenizer so both see the same files in the same order.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tokenizer import EOS, stdlib_dir, stdlib_sources  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_config(vocab_size: int, eos_id: int):
    from transformers import Mamba2Config

    return Mamba2Config(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=6,
        state_size=64,
        head_dim=32,
        expand=2,
        num_heads=16,  # expand * hidden_size / head_dim; Mamba2Config checks the product
        # transformers defaults to 8 groups (the 2.7B checkpoint's value); one group is what the
        # server's kernels are written for first and is plenty for a model this small.
        n_groups=1,
        conv_kernel=4,
        chunk_size=64,
        tie_word_embeddings=True,  # the embedding is ~30% of the weights; tying keeps the file small
        # The default 0.1 is far too large a std for a 256-wide embedding tied to the output head.
        initializer_range=0.02,
        rescale_prenorm_residual=True,
        # The default upper limit is +inf, which config.json can only hold as a non-standard token
        # (and transformers releases spell it differently); dt never gets near 1e3, so this is the
        # same model with a config that any JSON parser and any transformers 5.x read.
        time_step_limit=(0.0, 1000.0),
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
    )


def split_is_val(rel_path: str, val_permille: int) -> bool:
    # Hash of the path, not of the position in the list: the split stays the same when files are
    # added or removed between Python versions.
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h % 1000 < val_permille


def build_corpus(tokenizer_path: Path, stdlib: Path | None, val_permille: int):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos_id = tok.token_to_id(EOS)
    files = stdlib_sources(stdlib)
    enc = tok.encode_batch([text for _, text in files])
    train, val, n_val_files = [], [], 0
    for (rel, _), e in zip(files, enc):
        # Each file is preceded by <|endoftext|>: the model learns that eos ends a document and that
        # what follows it is the start of a fresh file.
        dest = val if split_is_val(rel, val_permille) else train
        n_val_files += dest is val
        dest.append(eos_id)
        dest.extend(e.ids)
    return tok, eos_id, torch.tensor(train, dtype=torch.long), torch.tensor(val, dtype=torch.long), len(files), n_val_files


def lr_at(progress: float, step: int, args) -> float:
    """Linear warmup, then cosine decay to 10% of the peak over `progress` in [0, 1]."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def next_loss(model, x: torch.Tensor, autocast) -> torch.Tensor:
    with autocast():
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
    # Cross-entropy in float32: bf16 log-softmax over 4096 classes loses ~0.01 nats of precision.
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, val: torch.Tensor, seq_len: int, batch_size: int, max_windows: int, autocast) -> float:
    """Mean next-token loss over fixed, non-overlapping windows of the held-out files."""
    model.eval()
    n = min((len(val) - 1) // seq_len, max_windows)
    windows = torch.stack([val[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    total = 0.0
    for i in range(0, n, batch_size):
        xb = windows[i : i + batch_size]
        total += next_loss(model, xb, autocast).item() * len(xb)
    model.train()
    return total / max(n, 1)


def fmt_time(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/mamba2-tiny-pystdlib")
    ap.add_argument("--tokenizer", default=None, help="dir with tokenizer.json (default: --out)")
    ap.add_argument("--stdlib", type=Path, default=None, help="corpus root (default: this Python's stdlib)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=20000, help="upper bound; --max-minutes usually ends first")
    ap.add_argument("--max-minutes", type=float, default=6.0, help="training-time budget (excl. data prep and save)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=512, help="cap on held-out 512-token windows per eval")
    ap.add_argument("--val-permille", type=int, default=20, help="held-out share of files, in 1/1000")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import GenerationConfig, Mamba2ForCausalLM

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    out = Path(args.out)
    tok_dir = Path(args.tokenizer) if args.tokenizer else out
    t_start = time.time()

    tok, eos_id, train, val, n_files, n_val_files = build_corpus(tok_dir / "tokenizer.json", args.stdlib, args.val_permille)
    print(
        f"corpus {args.stdlib or stdlib_dir()} (Python {platform.python_version()}): {n_files} files, "
        f"train {len(train) / 1e6:.2f} M tokens, val {n_val_files} files / {len(val) / 1e3:.1f} k tokens "
        f"({time.time() - t_start:.1f}s)",
        flush=True,
    )

    config = model_config(tok.get_vocab_size(), eos_id)
    model = Mamba2ForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters (~{2 * n_params / 1e6:.1f} MB in bf16)", flush=True)

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

        def autocast():
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        # bf16 autocast on CPU is slow and only used for smoke tests here; stay in float32.
        import contextlib

        autocast = contextlib.nullcontext

    # No weight decay on norms, biases and the SSM's per-head scalars (A_log, D, dt_bias): decaying
    # them toward zero changes the dynamics (e.g. A -> -1) rather than regularising.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )

    train = train.to(device)
    val = val.to(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1, device=device)
    tokens_per_step = args.batch_size * args.seq_len
    budget_s = args.max_minutes * 60

    log = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "argv": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "n_params": n_params,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "n_files": n_files,
        "n_val_files": n_val_files,
        "train": [],
        "val": [],
    }
    import transformers

    log["transformers"] = transformers.__version__

    def write_log():
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")

    best = (float("inf"), -1, None)  # (val loss, step, state dict on device)
    t_train = time.time()
    # Summed on the device and read once per log line: a .item() every step would stall the GPU.
    loss_sum, loss_n, step = torch.zeros((), device=device), 0, 0
    model.train()
    while step < args.steps:
        elapsed = time.time() - t_train
        if elapsed > budget_s:
            print(f"time budget of {args.max_minutes} min reached at step {step}", flush=True)
            break
        # Whichever runs out first, steps or minutes, drives the cosine, so a time-limited run still
        # ends at a low learning rate instead of being cut off at the peak.
        progress = max(step / args.steps, elapsed / budget_s)
        lr = lr_at(progress, step, args)
        for g in opt.param_groups:
            g["lr"] = lr

        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch_size,), device=device, generator=gen)
        x = train[starts[:, None] + offsets]
        loss = next_loss(model, x, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_sum += loss.detach()
        loss_n += 1

        if step % args.log_every == 0 or step <= 3:
            mean_loss = loss_sum.item() / loss_n  # mean over the steps since the last log line
            elapsed = time.time() - t_train
            tps = step * tokens_per_step / elapsed
            remaining = min(budget_s - elapsed, (args.steps - step) * elapsed / step)
            print(
                f"step {step:6d}  loss {mean_loss:.4f}  lr {lr:.2e}  {tps / 1e3:8.1f} k tok/s  "
                f"elapsed {fmt_time(elapsed)}  eta {fmt_time(max(remaining, 0))}",
                flush=True,
            )
            log["train"].append(
                {"step": step, "loss": round(mean_loss, 5), "lr": lr, "tokens_per_s": round(tps), "elapsed_s": round(elapsed, 1)}
            )
            loss_sum.zero_()
            loss_n = 0

        if step % args.eval_every == 0:
            v = evaluate(model, val, args.seq_len, args.batch_size, args.eval_windows, autocast)
            log["val"].append({"step": step, "loss": round(v, 5), "elapsed_s": round(time.time() - t_train, 1)})
            print(f"step {step:6d}  VAL loss {v:.4f}  ppl {math.exp(v):.2f}", flush=True)
            if v < best[0]:
                best = (v, step, copy.deepcopy(model.state_dict()))
            write_log()

    train_s = time.time() - t_train
    v = evaluate(model, val, args.seq_len, args.batch_size, args.eval_windows, autocast)
    if not log["val"] or log["val"][-1]["step"] != step:
        log["val"].append({"step": step, "loss": round(v, 5), "elapsed_s": round(train_s, 1)})
    print(f"final step {step}  VAL loss {v:.4f}  ppl {math.exp(v):.2f}", flush=True)
    if v > best[0]:
        # The corpus is small enough to overfit; ship the weights with the best held-out loss.
        print(f"restoring best checkpoint from step {best[1]} (val {best[0]:.4f})", flush=True)
        model.load_state_dict(best[2])
        v = best[0]
        saved_step = best[1]
    else:
        saved_step = step

    log.update(
        steps=step,
        train_seconds=round(train_s, 1),
        tokens_seen=step * tokens_per_step,
        mean_tokens_per_s=round(step * tokens_per_step / train_s),
        saved_step=saved_step,
        final_val_loss=round(v, 5),
        final_val_ppl=round(math.exp(v), 3),
    )

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16).cpu()
    # transformers 5 always writes safetensors (the safe_serialization flag is gone); older releases
    # needed it. Pass it only where the signature still has it so both work.
    import inspect

    kw = {"safe_serialization": True} if "safe_serialization" in inspect.signature(model.save_pretrained).parameters else {}
    model.save_pretrained(out, **kw)
    GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        do_sample=True,
        temperature=0.7,
        top_p=0.95,
        max_new_tokens=128,
    ).save_pretrained(out)
    if tok_dir.resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            shutil.copy(tok_dir / name, out / name)
    size = (out / "model.safetensors").stat().st_size
    log["safetensors_bytes"] = size
    write_log()
    print(f"saved to {out}: model.safetensors {size / 1e6:.2f} MB, total wall {fmt_time(time.time() - t_start)}", flush=True)
    if size > 10 * 1000 * 1000:
        sys.exit("model.safetensors is over the 10 MB budget")


if __name__ == "__main__":
    main()
