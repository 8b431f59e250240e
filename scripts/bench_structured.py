"""Constrained decoding on the CPU: decode tok/s and acceptance length of AR, chain and DDTree with
the output constrained to a JSON Schema (grammar.py), beside the same modes unconstrained, side by
side in one run; and the mask's cost (constrained AR vs free AR). Greedy; the first prompt of each
configuration compiles (not counted). Prints JSON and a table.

  python scripts/bench_structured.py --modes ar,chain,ddtree \\
      --json_out bench_out/structured_cpu/structured.json
"""

import json
import os
import statistics
import sys

from absl import app, flags

from dflash_jax import target_flags

_TF = target_flags.define()
flags.adopt_module_key_flags(target_flags)
_MODES = flags.DEFINE_list("modes", ["ar", "chain", "ddtree"], "Decode modes to measure.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "Tokens generated at most per prompt.")
_MAX_CTX = flags.DEFINE_integer("max_ctx", 512, "Context (cache rows).")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here too.")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "category": {"enum": ["person", "place", "thing", "idea"]},
    "summary": {"type": "string", "maxLength": 160},
    "facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3}},
    "required": ["name", "category", "summary", "facts"], "additionalProperties": False}

PROMPTS = [  # general-knowledge requests (no evaluation set)
    "Describe the Eiffel Tower as a JSON record.",
    "Give a JSON record about Marie Curie.",
    "Describe a bicycle as a JSON record.",
    "Give a JSON record about the idea of democracy.",
    "Describe the Amazon river as a JSON record.",
    "Give a JSON record about Python, the programming language.",
    "Describe a violin as a JSON record.",
    "Give a JSON record about the city of Tokyo.",
    "Describe photosynthesis as a JSON record.",
]


def main(argv):
  del argv
  import jsonschema
  import dflash_jax as dj
  from dflash_jax import api, cli, grammar

  target = target_flags.load(_TF)
  draft = dj.load_draft(cli.find_draft_dir(target), target)
  g = api.grammar_compiler(target).compile(grammar.json_schema_regex(SCHEMA))
  prompts = [cli.build_prompt(target, p, chat=True) for p in PROMPTS]
  rows, outputs = [], {}
  for constrained in (True, False):
    for mode in _MODES.value:
      tok_s, acc, valid, n_tok = [], [], 0, 0
      for i, ids in enumerate(prompts):
        r = dj.generate(target, draft, ids, max_new_tokens=_MAX_NEW.value, mode=mode,
                        max_ctx=_MAX_CTX.value, grammar=g if constrained else None)
        outputs[(constrained, mode, i)] = r.tokens
        if i == 0:
          continue                                   # compiles
        tok_s.append(r.decode_tok_s)
        acc.append(r.mean_accept_len)
        n_tok += len(r.tokens)
        if constrained and r.stop_reason == "eog":
          try:
            jsonschema.validate(json.loads(target.tokenizer.decode(r.tokens)), SCHEMA)
            valid += 1
          except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
      rows.append({"constrained": constrained, "mode": mode,
                   "decode_tok_s_median": statistics.median(tok_s),
                   "mean_acceptance_length": statistics.mean(acc), "tokens": n_tok,
                   "prompts": len(prompts) - 1,
                   "valid_json": valid if constrained else None})
  same = {m: all(outputs[(True, m, i)] == outputs[(True, "ar", i)] for i in range(len(prompts)))
          for m in _MODES.value if "ar" in _MODES.value}
  ar_c = next((r for r in rows if r["mode"] == "ar" and r["constrained"]), None)
  ar_f = next((r for r in rows if r["mode"] == "ar" and not r["constrained"]), None)
  res = {"command": "python scripts/bench_structured.py " + " ".join(sys.argv[1:]),
         "target": os.path.basename(target.path), "draft": draft.path, "schema": SCHEMA,
         "rows": rows, "constrained_equals_constrained_ar": same,
         "mask_cost_ar": (ar_f["decode_tok_s_median"] / ar_c["decode_tok_s_median"]
                          if ar_c and ar_f else None)}
  print(json.dumps(res, indent=1))
  print(f"\n{'constrained':>11} {'mode':>7} {'tok/s':>7} {'accept':>7} {'valid':>6}")
  for r in rows:
    v = f"{r['valid_json']}/{r['prompts']}" if r["constrained"] else "-"
    print(f"{str(r['constrained']):>11} {r['mode']:>7} {r['decode_tok_s_median']:7.1f} "
          f"{r['mean_acceptance_length']:7.2f} {v:>6}")
  if _JSON.value:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
