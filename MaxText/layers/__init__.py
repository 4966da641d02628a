"""Shared building blocks. Einsum legend used throughout:

B batch, T query length, S key length, D model (embedding) dim, N query heads, K key/value heads,
G query heads per key/value head (N = K*G), H head dim, F mlp dim, V vocabulary, L layers.
"""
