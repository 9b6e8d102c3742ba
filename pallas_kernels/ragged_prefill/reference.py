"""The chunked prefill kernel's oracle: kvjax's float32 jnp reference, same leading arguments."""

from kvjax.kv.attention import paged_prefill_attention_reference

__all__ = ["paged_prefill_attention_reference"]
