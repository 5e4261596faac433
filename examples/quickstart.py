import torch
import openmsa

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"   # on the CPU the ops run the reference
# MiniMax-M3's geometry (openmsa.MSAConfig()): 64 q / 4 kv / 4 index heads, blocks of 128, top-16
# one step: request 0 decodes at 3000 tokens, request 1 verifies 3 draft tokens at 900
cu_seqlens_q = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
seq_lens = torch.tensor([3000, 900], dtype=torch.int32, device=device)
block_table = torch.arange(48, dtype=torch.int32, device=device).view(2, 24)  # pages per request
index_cache = torch.randn(48, 128, 128, device=device).to(torch.float8_e4m3fn)  # [pages, B, Di]
k_cache = torch.randn(48, 128, 4, 128, device=device, dtype=torch.bfloat16)   # [pages, B, Hkv, D]
v_cache = torch.randn_like(k_cache)
index_q = torch.randn(4, 4, 128, device=device).to(torch.float8_e4m3fn)       # [T, H, Di]
q = torch.randn(4, 64, 128, device=device, dtype=torch.bfloat16)              # [T, Hq, D]

indices = openmsa.select_blocks(index_q, index_cache, cu_seqlens_q, seq_lens, block_table,
                                max_q_len=3)  # optional: the step's longest q_len, a speed hint
out, lse = openmsa.sparse_attention(q, k_cache, v_cache, indices, cu_seqlens_q, seq_lens,
                                    block_table, return_lse=True)
print(indices.shape, out.shape, lse.shape)  # [T, H, 16] block ids, [T, Hq, D], [T, Hq]
print(indices[0, 0].tolist())   # the decode token's 16 blocks, its own block (23) among them
print(indices[1, 0].tolist())   # the first verify token (position 897): 8 blocks, -1 padded
