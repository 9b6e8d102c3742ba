"""The oracle of the paged decode kernel: kvjax's float32 jnp reference, same leading arguments."""

from kvjax.kv.attention import paged_decode_attention_reference

__all__ = ["paged_decode_attention_reference"]
