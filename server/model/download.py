"""``python -m mambaserve.server.model.download REPO REVISION DEST``: fetch only what the server loads.

What the operator's model-download Job and init container run (in the server image, which has
``huggingface_hub`` through ``transformers``). Only the files the server reads are fetched
(config, tokenizer, weights); when a repository has safetensors weights its PyTorch ``.bin`` copies
are skipped, since the server prefers safetensors (server/model/weights.py). A marker file written
last makes a finished download a no-op on the next run and tells readers the directory is complete.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
from collections.abc import Callable, Iterable, Sequence

# The files server/model reads: a Hugging Face Mamba2 checkpoint (safetensors, single or sharded)
# or a mamba_ssm one (config.json + pytorch_model.bin, single or sharded), and tokenizer files.
ALLOW = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "model.safetensors", "model-*.safetensors", "model.safetensors.index.json",
         "pytorch_model.bin", "pytorch_model-*.bin", "pytorch_model.bin.index.json")
MARKER = ".mambaserve-download-complete"


def select(files: Iterable[str], allow: Sequence[str] = ALLOW) -> list[str]:
    """The repository files to fetch: those matching ``allow`` (top level only), without ``.bin``
    weights when safetensors weights are there."""
    chosen = [f for f in files if "/" not in f and any(fnmatch.fnmatchcase(f, p) for p in allow)]
    if any(f.endswith(".safetensors") for f in chosen):
        chosen = [f for f in chosen if not f.endswith(".bin") and f != "pytorch_model.bin.index.json"]
    return sorted(chosen)


def marker_text(repo: str, revision: str) -> str:
    return f"{repo}@{revision}\n"


def is_complete(dest: str, repo: str, revision: str) -> bool:
    try:
        with open(os.path.join(dest, MARKER)) as f:
            return f.read() == marker_text(repo, revision)
    except OSError:
        return False


def download(repo: str, revision: str, dest: str, allow: Sequence[str] = ALLOW,
             list_files: Callable[[str, str], list[str]] | None = None,
             fetch: Callable[[str, str, str, list[str]], None] | None = None) -> list[str]:
    """Fetch the selected files into ``dest`` and write the marker; returns the files (empty when
    ``dest`` was already complete). ``list_files`` and ``fetch`` default to huggingface_hub's."""
    if is_complete(dest, repo, revision):
        return []
    if list_files is None or fetch is None:
        from huggingface_hub import HfApi, snapshot_download

        def list_files(r: str, rev: str) -> list[str]:
            return HfApi().list_repo_files(r, revision=rev)

        def fetch(r: str, rev: str, d: str, names: list[str]) -> None:
            snapshot_download(repo_id=r, revision=rev, local_dir=d, allow_patterns=names)
    files = select(list_files(repo, revision), allow)
    if "config.json" not in files or not any(f.endswith((".safetensors", ".bin")) for f in files):
        raise SystemExit(f"{repo}@{revision} has no checkpoint the server loads (config.json and "
                         f"safetensors or pytorch_model.bin weights); files matched: {files}")
    os.makedirs(dest, exist_ok=True)
    fetch(repo, revision, dest, files)
    tmp = os.path.join(dest, MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(marker_text(repo, revision))
    os.replace(tmp, os.path.join(dest, MARKER))
    return files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mambaserve.server.model.download",
                                     description="Download the files of a checkpoint the server loads.")
    parser.add_argument("repo")
    parser.add_argument("revision")
    parser.add_argument("dest")
    parser.add_argument("--allow", action="append", default=None, help="file pattern to fetch (repeatable)")
    args = parser.parse_args(argv)
    files = download(args.repo, args.revision, args.dest, tuple(args.allow) if args.allow else ALLOW)
    print(f"{args.repo}@{args.revision}: " + (f"fetched {len(files)} files into {args.dest}: {', '.join(files)}"
                                              if files else f"already complete in {args.dest}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
