"""attn_jax: attention variants that make softmax attention aware of what matters.

Importing this package has no side effects (no flag parsing, no device queries).
"""

__version__ = "0.1.0"
