"""Numeric kernels: `reference.py` (pure torch, the CPU path and the oracle) and TileLang CUDA
kernels with the same contracts, chosen by `backend.py`. Importing any module here imports no
GPU library: TileLang is imported inside the functions that build kernels.

By operation:
  shared          toolkit.py (compile, device, tile tables, input errors), lowbit.py (FP8/FP4
                  decoding by bit moves), pdl.py (programmatic dependent launch), gemv.py (the
                  row-per-warp GEMV building blocks), bf16_gemv.py
  FP8 linears     act_quant.py, fp8_gemm.py (dispatch: CUDA-core GEMV, cuBLAS prefill),
                  fp8_mma_one_token.py, fp8_mma_few_tokens.py (the tensor cores: one token, 2-16
                  tokens), grouped_linear.py (wo_a; grouped_mma_few_tokens.py: its 2-16 tokens)
  routed experts  fp4_moe.py (dispatch and the CUDA-core GEMV), fp4_mma_one_token.py,
                  fp4_mma_few_tokens.py (tensor cores: one token, 2-16 tokens), moe_gate.py,
                  swiglu_quant.py, moe_combine.py
  attention       norm_rope.py, rope.py, compressor_project.py, compressor_pool.py, indexer_weights.py,
                  indexer_scores.py, hadamard_qdq4.py, sparse_index.py, index_picks.py,
                  sparse_attention.py
  mHC and norms   mhc.py, sinkhorn.py (a warp macro used by mhc.py), rms_norm.py,
                  rms_norm_quant.py
  output head     head_gemv.py
"""
