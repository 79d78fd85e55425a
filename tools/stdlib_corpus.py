"""The training text of the tiny Ouro: the running interpreter's standard library, split by file.

Corpus: the `*.py` files of `sysconfig.get_paths()["stdlib"]`, without site-packages and without
any directory named `test*` (that covers `idle_test`), `encodings` (generated codec tables) or
`pydoc_data` (help text). With b = crc32(relative path) % 100, a file is held out (test) when
b < 5 and used for validation when 5 <= b < 15, so the split does not depend on the machine or on
the order files are listed. Documents are joined with `<|endoftext|>` (id 0).
"""

from __future__ import annotations

import sys
import sysconfig
import zlib
from pathlib import Path

import torch

EOS_ID = 0  # <|endoftext|>, also the document separator
SPLITS = ("train", "valid", "held_out")
HELD_OUT_PERCENT = 5  # crc32 bucket < 5: held out; < 15: validation; else training
VALID_PERCENT = 10
SKIPPED_DIRS = ("encodings", "pydoc_data")  # generated codec tables and help text, not code


def stdlib_files() -> tuple[Path, list[str]]:
    """The stdlib root and the sorted relative paths of its non-test *.py files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        dirs = parts[:-1]
        if any(d in ("site-packages", *SKIPPED_DIRS) or d.startswith("test") for d in dirs):
            continue
        rel.append("/".join(parts))
    return root, sorted(rel)


def split_of(rel_path: str) -> str:
    """'held_out', 'valid' or 'train', from the crc32 of the relative path."""
    bucket = zlib.crc32(rel_path.encode()) % 100
    if bucket < HELD_OUT_PERCENT:
        return "held_out"
    return "valid" if bucket < HELD_OUT_PERCENT + VALID_PERCENT else "train"


def held_out_files() -> tuple[Path, list[str]]:
    """The stdlib root and its held-out files (the evaluation prompts come from them)."""
    root, files = stdlib_files()
    return root, [f for f in files if split_of(f) == "held_out"]


def load_corpus(max_train_files: int | None) -> tuple[dict[str, list[str]], dict]:
    """Texts per split ('train', 'valid', 'held_out') and a description for the card."""
    root, files = stdlib_files()
    split = {name: [f for f in files if split_of(f) == name] for name in SPLITS}
    if max_train_files is not None:
        split = {
            name: fs[: max_train_files if name == "train" else max(2, max_train_files // 10)]
            for name, fs in split.items()
        }

    def read(rel: str) -> str:
        return (root / rel).read_text(encoding="utf-8", errors="replace")

    info = {
        "stdlib": str(root),
        "python": sys.version.split()[0],
        "num_train_files": len(split["train"]),
        "num_valid_files": len(split["valid"]),
        "num_held_out_files": len(split["held_out"]),
        "split_rule": f"b = crc32(relative path) % 100: b < {HELD_OUT_PERCENT} held out, "
        f"b < {HELD_OUT_PERCENT + VALID_PERCENT} validation, else training",
    }
    return {name: [read(f) for f in fs] for name, fs in split.items()}, info


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one int64 stream, each preceded by <|endoftext|>."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.append(EOS_ID)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)
