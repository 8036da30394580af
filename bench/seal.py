"""What sealing and verifying a checkpoint cost: bytes read back and seconds, the checksums
computed as the files are written (checkpoints/sums.py, xxh3-128) against the way before
them (the files written by the safetensors package, then read back whole and hashed with
sha256 to seal them, and read and hashed again by every reader).

    python bench/seal.py                       # a 1 GB checkpoint: 0.25 GB weights, 0.75 GB state
    python bench/seal.py --gb 4 --out /tmp/seal.json

Both ways write the same tensors (fp32 weights and AdamW's two moments, 12 bytes a
parameter) into a directory of this machine's disk, one after the other, in one run:

- write: the trainer writing its files (the new way sums as it writes);
- seal: the checkpoint node's manifest (before: every file read back and hashed);
- engine verify: what a rank reads before its engines serve the checkpoint (before: every
  file; now: the weights only);
- trainer verify: what a trainer reads to check the checkpoint before it loads it (both: all).

Bytes read are the bytes the code asks for (a file read back counts whole); the page cache
makes the reads here faster than a shared filesystem's. Writes JSON (default
bench/results/seal.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.checkpoints import manifest, sums  # noqa: E402


def _tensors(gb: float) -> tuple[dict, dict]:
    import torch

    params = int(gb * 1e9 / 12)
    rows = max(1, params // 4096)
    g = torch.Generator().manual_seed(0)
    weights = {f"layer{k}.weight": torch.randn(rows // 8, 4096, generator=g) for k in range(8)}
    state = {f"{n}/{m}": torch.randn_like(t) for n, t in weights.items() for m in ("exp_avg", "exp_avg_sq")}
    return weights, state


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def before(directory: Path, weights: dict, state: dict) -> dict:
    from safetensors.torch import save_file

    files = [directory / "model.safetensors", directory / "optimizer" / "adamw.safetensors"]
    (directory / "optimizer").mkdir(parents=True)
    out = {"write_s": _timed(lambda: (save_file(weights, files[0]), save_file(state, files[1])))}
    every = sum(p.stat().st_size for p in files)
    out["seal_s"] = _timed(lambda: [_sha256(p) for p in files])
    out["engine_verify_s"] = _timed(lambda: [_sha256(p) for p in files])
    out["trainer_verify_s"] = _timed(lambda: [_sha256(p) for p in files])
    out.update(seal_read_bytes=every, engine_read_bytes=every, trainer_read_bytes=every, checkpoint_bytes=every)
    return out


def after(directory: Path, weights: dict, state: dict) -> dict:
    (directory / "optimizer").mkdir(parents=True)

    def write():
        written = sums.Sums(directory, "worker-0")
        written.save_safetensors(directory / "model.safetensors", weights)
        written.save_safetensors(directory / "optimizer" / "adamw.safetensors", state)
        written.record()

    out = {"write_s": _timed(write)}
    out["seal_s"] = _timed(lambda: manifest.seal(directory))
    out["engine_verify_s"] = _timed(lambda: manifest.verify(directory, manifest.WEIGHTS))
    out["trainer_verify_s"] = _timed(lambda: manifest.verify(directory, manifest.ALL))
    weights_bytes = (directory / "model.safetensors").stat().st_size
    every = weights_bytes + (directory / "optimizer" / "adamw.safetensors").stat().st_size
    out.update(seal_read_bytes=0, engine_read_bytes=weights_bytes, trainer_read_bytes=every, checkpoint_bytes=every)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size (weights and state), GB")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "seal.json")
    args = parser.parse_args()
    weights, state = _tensors(args.gb)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        result = {"gb": args.gb, "before": before(root / "before", weights, state), "after": after(root / "after", weights, state)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    b, a = result["before"], result["after"]
    result["ratio"] = {k: round(a[k] / b[k], 4) if b[k] else None for k in b if k != "checkpoint_bytes"}
    print(f"{'':18}{'before':>12}{'after':>12}{'ratio':>8}")
    for k in b:
        print(f"{k:18}{b[k]:>12.3f}{a[k]:>12.3f}" + (f"{result['ratio'][k]:>8.3f}" if result["ratio"].get(k) is not None else "")
              if k.endswith("_s") else f"{k:18}{b[k] / 1e9:>10.3f}GB{a[k] / 1e9:>10.3f}GB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
