"""Derive tests/data from the public fixtures (run once by a developer; tests never read ../shared).

  python tests/data/make_test_data.py /path/to/shared/fixtures

Copies the tiny Qwen3.5 GGUFs (the f32 one xz-compressed: 23 MB -> 8 MB, decompressed by the tests
into a temp dir; the q8_0 one as a recipe over the f32 one, tests/gguf_recipe.py), the tiny z-lab
draft, and the subset of reference arrays the tests use.
"""

import json
import lzma
import os
import shutil
import sys

import numpy as np

SRC = sys.argv[1]
DST = os.path.dirname(os.path.abspath(__file__))


def _xz(src: str, dst: str, preset: int) -> None:
  """Copy src to dst xz-compressed at `preset`."""
  with open(src, "rb") as fin, lzma.open(dst, "wb", preset=preset) as fout:
    shutil.copyfileobj(fin, fout)


def main():
  q = os.path.join(DST, "qwen35_tiny")
  os.makedirs(q, exist_ok=True)
  shutil.copy(os.path.join(SRC, "qwen35_tiny", "model-q4_k_m.gguf"), q)
  with open(os.path.join(SRC, "qwen35_tiny", "model-f32.gguf"), "rb") as fh:
    with lzma.open(os.path.join(q, "model-f32.gguf.xz"), "wb", preset=6) as out:
      out.write(fh.read())
  # the Q8_0 file as a recipe over the F32 one (6.2 MB -> 6 KB; conftest rebuilds it, sha256-checked)
  sys.path.insert(0, os.path.dirname(DST))
  import gguf_recipe
  gguf_recipe.write_recipe(os.path.join(SRC, "qwen35_tiny", "model-q8_0.gguf"),
                           os.path.join(SRC, "qwen35_tiny", "model-f32.gguf"),
                           os.path.join(q, "model-q8_0.recipe.npz"))
  ref = np.load(os.path.join(SRC, "qwen35_tiny", "reference.npz"))
  keep = ["tokens", "hf_logits", "hf_greedy", "hf_dequant_logits_q8_0", "hf_dequant_logits_q4_k_m",
          "hf_dequant_greedy_q8_0", "hf_dequant_greedy_q4_k_m", "llamacpp_logits_q4_k_m_kvf32"]
  np.savez_compressed(os.path.join(q, "reference.npz"), **{k: ref[k] for k in keep})

  d = os.path.join(DST, "dflash_tiny")
  os.makedirs(d, exist_ok=True)
  for name in ("config.json", "reference.npz"):
    shutil.copy(os.path.join(SRC, "dflash_tiny", name), d)
  _xz(os.path.join(SRC, "dflash_tiny", "model.safetensors"), os.path.join(d, "model.safetensors.xz"),
      9 | lzma.PRESET_EXTREME)          # 2.76 -> 1.97 MB (tests/conftest.py unpacked() unpacks it)

  d2 = os.path.join(DST, "dflash2_tiny")      # the DFlash-2 draft and the reference arrays used
  os.makedirs(d2, exist_ok=True)
  shutil.copy(os.path.join(SRC, "dflash2_tiny", "config.json"), d2)
  _xz(os.path.join(SRC, "dflash2_tiny", "model.safetensors"), os.path.join(d2, "model.safetensors.xz"),
      9)                                # 4.4 -> 3.2 MB (tests/conftest.py unpacked() unpacks it)
  ref2 = np.load(os.path.join(SRC, "dflash2_tiny", "reference.npz"))
  drop = ("trace_target_hidden", "oracle_trace_target_hidden", "trace_draft_logits_first",
          "draft_logits_raw", "pkg_unpatched_")
  np.savez_compressed(os.path.join(d2, "reference.npz"),
                      **{k: ref2[k] for k in ref2.files if not k.startswith(drop)})

  s = os.path.join(DST, "smollm2")
  os.makedirs(s, exist_ok=True)
  for name in ("tokenize.json", "prompts.jsonl"):
    shutil.copy(os.path.join(SRC, "smollm2", name), s)
  sref = np.load(os.path.join(SRC, "smollm2", "reference.npz"))
  rows = [0, 8, 16]
  out = {"logit_rows": np.asarray(rows, np.int32)}
  for line in open(os.path.join(SRC, "smollm2", "prompts.jsonl")):
    pid = json.loads(line)["id"]
    out[f"{pid}__prompt_ids"] = sref[f"{pid}__prompt_ids"]
    out[f"{pid}__greedy_ids"] = sref[f"{pid}__greedy_ids"]
    out[f"{pid}__hf_greedy_ids"] = sref[f"{pid}__hf_greedy_ids"]
    out[f"{pid}__llama_argmax"] = sref[f"{pid}__logits"].astype(np.float32).argmax(-1).astype(np.int32)
    out[f"{pid}__llama_logits_rows"] = sref[f"{pid}__logits"][rows]
    out[f"{pid}__hf_logits_rows"] = sref[f"{pid}__hf_logits"][rows]
  np.savez_compressed(os.path.join(s, "reference.npz"), **out)


if __name__ == "__main__":
  main()
