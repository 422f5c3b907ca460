"""JetSpec-JAX: speculative decoding for Qwen3-family models with causal parallel draft heads.

    import jetspec_jax as js
    target = js.load_target("smollm2-135m")
    print(js.generate(target, "Why is the sky blue?").texts[0])

The API names below come from `jetspec_jax.api`, imported on first use, so that importing
one submodule (`jetspec_jax.model.config`, ...) does not load the whole stack.
"""

_API = ("Target", "Draft", "GenerationResult", "load_target", "load_draft",
        "default_draft_path", "generate", "stream", "StreamChunk", "bench", "read_prompt_file")

__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        from jetspec_jax import api

        return getattr(api, name)
    raise AttributeError(f"module 'jetspec_jax' has no attribute {name!r}")
