import torch
import openmsa
from openmsa.model import random_layer_checkpoint

device = "cuda" if torch.cuda.is_available() else "cpu"
cfg = openmsa.MSAConfig()   # M3's attention; from a checkpoint: MSAConfig.from_hf_config(config)
hidden_size = 1024
# one TP4 rank (16 q / 1 kv / 1 index head); real weights: load_checkpoint(state_dict,
# prefix="model.layers.3.self_attn.") with q_proj.weight, ... under that prefix
layer = openmsa.MSAAttention(cfg, hidden_size, tp_size=4, tp_rank=0, device=device)
layer.load_checkpoint(random_layer_checkpoint(layer, torch.Generator().manual_seed(0)))
planner = openmsa.MSAPlanner(layer.config, max_requests=8, max_tokens=512, max_blocks=64,
                             device=device)

# paged caches of 64 pages of 128 tokens, as an engine holds them (random: earlier tokens' keys)
k_cache = torch.randn(64, 128, 1, 128, dtype=torch.bfloat16, device=device)  # [P, B, Hkv, D]
v_cache = torch.randn_like(k_cache)
index_cache = torch.randn(64, 128, 128, device=device).to(torch.float8_e4m3fn)  # [P, B, Di]
block_table = torch.arange(64, dtype=torch.int32, device=device).view(2, 32)

# a step: request 0 decodes its token 4000, request 1 prefills a 300-token prompt
q_lens, seq_lens = [1, 300], [4000, 300]
meta = planner.plan(q_lens, seq_lens, block_table)   # once per step, shared by every layer
hidden = torch.randn(sum(q_lens), hidden_size, dtype=torch.bfloat16, device=device)
out = layer(hidden, meta, (k_cache, v_cache), index_cache)   # no host sync: graph-capturable
print(out.shape, out.dtype)   # [301, 1024]: this rank's o_proj partial sum (all-reduce over TP)
