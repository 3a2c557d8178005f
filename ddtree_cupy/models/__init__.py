"""GPU models: the target (``target.GpuTarget``, weights in ``weights``), its static batch buffers
(``batch.TargetBatch``) and paged latent KV cache (``kv.GpuLatentCache``); the drafter lives in ``drafter``.
Interfaces: docs/CONTRACTS.md ("GPU models and engine"); kernel sequence and memory: docs/MODELS.md."""
