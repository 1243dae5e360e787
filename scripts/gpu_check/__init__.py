"""The GPU round trip against one real LMCache MP server in GPU mode (run by gpu_check.sh
through scripts/gpu_check.py).

Modules: ``plan`` (arguments, sides, block ids, L1 sizing), ``side_base`` (what a side
is; the client, pool mapping and copy timing our sides share), ``side_ours``,
``side_views``, ``side_lmcache`` (the clients), ``flow`` (one side's round trip, the
floors, the warm-up), ``report`` (the JSON and the table), ``restart`` (the SIGKILL
step), ``main`` (the run).

For each client side: allocate a paged bf16 KV cache on the GPU (Llama-3-8B's geometry
by default: 32 layers x 8 KV heads x 128), fill it with random bits, REGISTER (timed),
then for each size: STORE from source blocks (scattered over twice the blocks the
transfers need, as vLLM's block table is after a while), wait until LOOKUP sees every
chunk, RETRIEVE into other (zeroed) blocks, and compare on the GPU: destination ==
source bit for bit, every other block unchanged. Then UNREGISTER, and CLEAR the server
(the L1 holds one side's keys at a time). Each side runs on a torch stream of its own,
not the default stream (as an engine's transfers do not). Our sides share one
lmcache_mp Client, so one mapping of the server's pool, page-locked once at the start
(``env.pool.pool_pin_s``) and kept mapped by a small engine-driven registration until
the end. Sides:

* torch_ipc / raw / auto: lmcache_mp + CudaKVCache with that wrapper form
* engine:                 lmcache_mp + CudaKVCache registered with mode="engine": this
                          client copies between the GPU blocks and the server's SHM L1
                          pool with CUDA copies (no CUDA IPC; lmcache_mp.ipc.cuda.staging),
                          plus plain copies of the same bytes as the bandwidth floor:
                          device <-> torch's pinned buffer, and device <-> a shared
                          mapping registered with cudaHostRegister (the pool's kind of
                          memory); the copy phase alone (between PREPARE and COMMIT) is
                          timed beside the end-to-end figure (server started with
                          --shm-name and --no-l1-use-lazy by gpu_check.sh)
* nhd_views:              lmcache_mp + CudaKVCache.from_torch over vLLM-style layers:
                          per-layer NHD [2, blocks, block_size, heads, head_dim] views
                          into ONE torch allocation (each at an offset inside it; the
                          layout read from the strides), registered LMCache-driven
                          (wrapper "auto"). A round trip cannot see a layout the
                          server misreads (the same permutation both ways), so each
                          stored key is also retrieved engine-driven (this client's
                          NHD copy plan reads the server's chunk objects) and compared.
                          The CPU dry run uses an NHD CpuKVCache (HND on 0.5.3 / 0.5.4,
                          whose CPU servers refuse NHD)
* vllm_views / vllm_blocks_first:
                          what the connector registers for vLLM 0.32's OWN KV caches:
                          per-layer 4-D fused K/V views [blocks, heads, block_size,
                          2 * head_size] of ONE allocation, with the shapes, strides and
                          offsets vLLM's allocate_kv_cache made (recorded from vLLM in
                          fixtures/vllm/kv_layouts.json by tools/gen_vllm_kv_layouts.py:
                          8 layers, 8 KV heads of 128, blocks of 16), rebuilt with
                          torch.as_strided and wrapped by the connector's wrap_layers.
                          vllm_views: LBNHC (vLLM's default on a GPU), registered
                          LMCache-driven, each key re-read engine-driven as nhd_views
                          does (the server's GPU copy of fused layers must write the
                          objects this client's plan reads); vllm_blocks_first: BLHNC
                          (every layer's block in one page), engine-driven (the only mode
                          lmcache_mp registers it in). Their own sizes (256 and 4096
                          tokens; the dry run: the tiny recorded geometry, 256)
* mla / mla_engine:       an MLA cache (one latent plane of 576 per token and layer,
                          DeepSeek-style), LMCache-driven and engine-driven
* lmcache:                LMCache's own worker client (LMCacheDrivenTransferContext over
                          its MessageQueueClient (0.5.3) or RequestClient (0.5.6)),
                          the way vLLM's adapter drives it, producer event kept alive
                          until the reply as the adapter does

A run must never be lost on a lent device, so: every request has a deadline
(``--request-timeout``, ~20 s); each side runs in its own thread and is abandoned
(recorded as hung, with the step it hung in) after ``--side-timeout`` or at
``--deadline``; results are written to ``--out`` (JSON, with the table) after every
side and on SIGTERM; every side's cache stays allocated until the whole run ends (a
freed allocation that the server still maps must not alias the next side's memory);
zmq contexts are destroyed with linger 0, and the process leaves with ``os._exit``
so nothing hung can hold it.

Timings include the request, the server's copy and a host wait for its completion event
(LMCache's future waits on the host, so ours runs with wait_host=True); best of --reps.

Exit status: 0 every side that ran round-tripped, 1 a side failed or hung, 3 no GPU.
``--cpu-dry-run`` runs the same flow against a CPU-mode server with CpuKVCache and CPU
tensors, to rehearse this script on a machine without a GPU; it proves nothing about
CUDA. ``GPU_CHECK_FAULT=hang:SIDE,fail:SIDE`` provokes a hung or failing side (tests).
"""
