"""dflash-jax: lossless DFlash speculative decoding of GGUF targets in JAX.

Public API (see README.md):
  load_target(gguf_path, **options) -> Target
  load_draft(draft_dir, target) -> Draft
  forward_logits(target, token_ids) -> np.ndarray [T, V] float32
  first_draft_logits(target, draft, prompt_ids) -> np.ndarray [block_size-1, V] float32
  generate(target, draft, prompt_ids, *, max_new_tokens, config=DecodeConfig(...), **fields)
      -> GenerateResult
  generate_batch(target, draft, prompts, *, max_new_tokens, batch_size=None, **fields)
      -> list[GenerateResult]   (B slots in one compiled loop, continuous batching)
  PromptCache.for_target(target, max_bytes): prefix cache across `generate` calls (prompt_cache=)
  api.precompile(target, draft, prompt_len, ...): compile generate's programs ahead of time
  DecodeConfig (mode, block size, context, DDTree options), Runtime (kernels, dtypes).
"""

from dflash_jax.api import (Draft, GenerateResult, Target, first_draft_logits, forward_logits,
                            generate, generate_batch, load_draft, load_target)
from dflash_jax.config import DecodeConfig, DraftConfig, TargetConfig
from dflash_jax.prompt_cache import PromptCache
from dflash_jax.runtime import Runtime
from dflash_jax.sampling import SamplingConfig

__all__ = ["Draft", "GenerateResult", "Target", "first_draft_logits", "forward_logits", "generate",
           "generate_batch", "PromptCache",
           "load_draft", "load_target", "DecodeConfig", "DraftConfig", "Runtime", "SamplingConfig",
           "TargetConfig"]
__version__ = "0.1.0"
