"""The Lazarus worker runtime: MoE training with experts replicated as a plan says.

Module map, from the model outwards:

- ``config``: dataclass configs built from a LazarusJob's ``spec.runtime``;
- ``model``: the GPT-style MoE decoder; each MoE layer routes through a dispatcher;
- ``experts``: one rank's experts of a layer, run as one grouped GEMM;
- ``vocab_loss``: output projection and cross-entropy in chunks, fp32 logits never whole;
- ``flat_params``: parameters in flat buffers, fp32 master weights under bf16;
- ``host_sync``: moving data to the device without a wait, and counting the waits;
- ``data``: token sources and the step-indexed, world-size-independent batch order;
- ``kernels``: count, slot, permute and unpermute ops (Triton, with torch references);
- ``dispatch_counts``: Algorithm 1, the exact (expert, src, dst) token counts (pure);
- ``dispatcher``: ``LocalDispatcher`` (reference) and ``ReplicaDispatcher`` (Algorithm 1);
- ``replica_sync``: summing expert gradients over replicas with two all-to-alls;
- ``collectives``: the few collectives a step uses, with interruptible, bounded waits;
- ``process_group``: joining and leaving one plan generation's group;
- ``engine``: one worker's model, optimizer and step, plus state for migration.
"""
