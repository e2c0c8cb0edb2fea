"""Peer timing on the GPU machine: torch SDPA (flash and cuDNN backends) on the FlashAttention-2 paper's grid (hidden 2048, b x s = 16k).

Same shapes, layout and timing method (CUDA events, 3 warm-up calls, median of 30) as
`fwd_harness bench`, so that its table can be read next to ours from the same run.
Usage: python3 tools/torch_peer.py [d ...]   (`tools/gpu.sh harness torch` on the GPU machine)
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def bench(fn, iters=30):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main():
    dims = [int(a) for a in sys.argv[1:]] or [64, 128]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'backend':7} {'dtype':5} {'d':>4} {'causal':>6} {'batch':>5} {'seqlen':>6} {'med_ms':>9} {'TFLOP/s':>8}")
    for backend, name in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.CUDNN_ATTENTION, "cudnn")):
        for dtype in (torch.bfloat16, torch.float16):
            for d in dims:
                for causal in (False, True):
                    for s in (512, 1024, 2048, 4096, 8192, 16384):
                        b, h = 16384 // s, 2048 // d
                        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
                        try:
                            with sdpa_kernel(backend):
                                ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                        except RuntimeError as e:  # backend unavailable for this shape
                            print(f"{name:7} skipped: {str(e)[:80]}")
                            break
                        flops = 4 * b * s * s * h * d / (2 if causal else 1)
                        dt = "bf16" if dtype == torch.bfloat16 else "fp16"
                        print(f"{name:7} {dt:5} {d:4} {int(causal):6} {b:5} {s:6} {ms:9.4f} {flops / ms / 1e9:8.1f}")


if __name__ == "__main__":
    main()
