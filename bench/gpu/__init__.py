"""The GPU kit: the project's own training path measured on one GPU, in one process, no Ray and no Prefect.

    python -m bench.gpu [--size 1b|toy] [--legs throughput,lora,checkpoint,resume,precision] [--out results.jsonl]

Everything is made on the spot (no hub, no downloads): a Llama-architecture model from a config (``1b``: Llama-3.2-1B's
shape, 1.24 B parameters, random init; ``toy``: a few thousand parameters, for CPU), documents of generated text
staged by the project's own staging (each packed row one whole document, so attention is plain causal), and the
project's ``Trainer`` driven through ``LocalRuntime`` -- the loop Ray Train runs. Each leg prints one line
``UNBROKEN_GPU {json}`` (and appends it to ``--out``):

- ``matmul``: a bf16 matrix product's TFLOP/s measured here, the yardstick for MFU next to the card's spec peak;
- ``throughput``: full fine-tune (bf16 autocast over fp32 master weights, fp32 AdamW moments, fused on CUDA, SDPA) for
  activation checkpointing off/on x ``torch.compile`` off/on: tokens/s, model TFLOP/s (6 N + 12 L H d S per token),
  MFU against the spec peak and against the measured matmul, peak memory;
- ``lora``: the same model with LoRA on every linear layer: tokens/s, peak memory;
- ``checkpoint``: training-thread time blocked per checkpoint, asynchronous write vs synchronous (device->host included);
- ``resume``: N steps straight vs N/2, a checkpoint, a new process resuming, N/2 more -- the final weights' sha256
  (``train.deterministic``), and the largest difference without it;
- ``precision``: parameters and AdamW moments fp32 in memory and in the checkpoint, the export in bf16;
- ``env``: the device, versions, and that neither Ray nor Prefect was imported.

On the lent GPU machine (no Ray, no Prefect, no pydantic): ``make gpu-wheels`` here, then ``make gpu-check`` there
(README, "On a GPU"). The product's Ray Train path on the same machine is ``bench/gpu/ray_train.py`` (``make
gpu-ray``), in a process of its own: these legs never import Ray. ``make test`` runs every leg at ``--size toy`` on the CPU (tests/unit/test_gpu_kit.py).
"""
