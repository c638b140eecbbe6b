"""Write the trained models as Hugging Face folders, plus the kit's checksums.

Every folder carries the same tokenizer.json (a draft must tokenize exactly like its target),
and a tokenizer_config.json naming the EOS token for tools that read it from there.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from specdec.core.models.checkpoint import save_model
from specdec.core.models.heads import EagleHead, MedusaHeads
from specdec.core.models.llama import LlamaForCausalLM
from specdec.tools.kit.profiles import EOS_TOKEN

FOLDERS = ("target", "draft", "medusa", "eagle")


def write_tokenizer(tokenizer_json: Path, folder: Path, max_length: int) -> None:
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "model_max_length": max_length}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_kit(
    out: Path, tokenizer_json: Path, target: LlamaForCausalLM, draft: LlamaForCausalLM, medusa: MedusaHeads,
    eagle: EagleHead, max_length: int,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_model(target, out / "target", dtype=torch.float16)
    save_model(draft, out / "draft", dtype=torch.float16)
    medusa.save(out / "medusa", dtype=torch.float16, base_model="../target")
    eagle.save(out / "eagle", dtype=torch.float16)
    for name in FOLDERS:
        write_tokenizer(tokenizer_json, out / name, max_length)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def kit_files(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*") if p.is_file() and p.name != "checksums.json")


def write_checksums(out: Path) -> dict[str, str]:
    sums = {p.relative_to(out).as_posix(): sha256(p) for p in kit_files(out)}
    (out / "checksums.json").write_text(json.dumps(sums, indent=2) + "\n")
    return sums


def verify_checksums(out: Path) -> list[str]:
    """Paths whose content differs from checksums.json, or that are missing or unlisted."""
    expected = json.loads((out / "checksums.json").read_text())
    actual = {p.relative_to(out).as_posix(): sha256(p) for p in kit_files(out)}
    return sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
