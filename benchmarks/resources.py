# SPDX-License-Identifier: Apache-2.0
"""Registers, spills and shared memory of the attention kernel for sm_90, on any machine (no GPU):
Triton compiles to PTX, Triton's bundled ptxas assembles it. The signature mirrors a runtime
launch on M3's packed fp8/bf16 cache (unit strides specialised as 1, the others divisible by 16),
so the counts match what Nsight Compute reports on the H200 (255 registers / 73.7 KB for fp8 with
whole 128-key blocks and 3 stages, 185 / 139 KB for bf16). Count before you measure:

    python3 benchmarks/resources.py fp8,64,3,4 bf16,64,3,4     # kv dtype, sub, stages, warps
    python3 benchmarks/resources.py --sass fp8,128,3,4         # + the main loop's instruction mix
    python3 benchmarks/resources.py tile:bf16,64,3,4 tile8:bf16,64,2,8   # kernels/tile.py's
                                                                       # (4 or 8 tokens per tile)
    python3 benchmarks/resources.py --sass index:fp8,128,32,3,4   # the indexer's prefill
                                  # launch (cache dtype, rows, blocks per split, stages, warps)
    MAXNREG=168 python3 benchmarks/resources.py index:fp8,128,32,3,4   # under ptxas' register cap
    python3 benchmarks/resources.py --sass idec:fp8,16,32,3,4   # the indexer's decode launch
    SASS_DUMP=/tmp/k.sass python3 benchmarks/resources.py --sass idec:fp8,16,32,3,4   # + all SASS
    python3 benchmarks/resources.py sel:search,1024,64,1 sel:sort,256,0,4   # the selection
                                  # (path, blocks per program, scratch, warps[, chunk])
    python3 benchmarks/resources.py --sass sel:search,64,0,1   # + its search loops (those
                                  # with a warp-wide sum, REDUX)
    python3 benchmarks/resources.py --sass nvfp4:8 nvfp4:16   # the Gluon NVFP4 decode launch
                                  # (rows a pass) and its loops over ring units (8 rows: the
                                  # blocks needing no causal mask, then the rest)
    python3 benchmarks/resources.py prep:16 prep:4   # prepare_and_select's fused launch (the
                                  # preparation's heads per tile) beside idec:fp8,16,64,3,4
    python3 benchmarks/resources.py amerge:8 tmerge:search tmerge:sort   # the merge launches
                                  # (the attention's partials; the indexer's candidates)
    python3 benchmarks/resources.py --sass rows:16,4,4,1   # the short-row selection (Gluon,
                                  # select_rows.py: groups, blocks per group, threads per row,
                                  # warps[, sort: rows sorted, not
                                  # searched]) and its search loop (the
                                  # one with shuffles)

With --sass each loop's line also counts its instructions on Hopper's ALU pipe (integer and
logic operations, compares, selects, min/max: half rate, 2 warp instructions per cycle per SM).

Programs per SM = min(65536 // (regs rounded up to 8 * 32 * warps), 228 KB // (smem + 1 KB)).
"""

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from openmsa.ops.attention.kernels.token import _sparse_attention_kernel
from openmsa.ops.attention.kernels.tile import _sparse_attention_tile_kernel
from openmsa.ops.indexer.kernels.scores import _block_scores_kernel

UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_ik", "stride_btb", "stride_od",
                "stride_lh"}
KV_TYPES = {"fp8": "*fp8e4nv", "bf16": "*bf16"}


def _loop_mix(sass: str, top: int = 12, marker: str = r"\b[HQ]?G?MMA"):
    """The innermost loops (backward branches whose bodies hold no other) that issue matrix
    instructions (HMMA, HGMMA, QGMMA; or what `marker` matches), in code order, in cuobjdump's
    SASS: a list of (instruction count, most frequent opcodes). A kernel may have several (the
    indexer's prefill launch: the unmasked scoring loop, then the loop over blocks that
    straddle the causal cut); an outer loop around them would also count the epilogue, so it is
    not reported."""
    found = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            found.append((int(m.group(1), 16), m.group(2).strip()))
    # (a branch may carry a second predicate: "@P1 BRA P2, 0xb80")
    loops = [(int(b.group(1), 16), addr) for addr, text in found
             if (b := re.search(r"BRA (?:!?U?P\d, )?(0x[0-9a-f]+)", text))
             and int(b.group(1), 16) < addr]
    inner = sorted((lo, hi) for lo, hi in loops
                   if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in loops))
    result = []
    for lo, hi in inner:
        body = [text for addr, text in found if lo <= addr <= hi]
        # (bodies that re-converge a diverged warp, WARPSYNC ... ENDCOLLECTIVE, are the
        # out-of-line fallback of a warp-wide operation, not the loop's fast path)
        if not any(re.search(marker, t) for t in body) or any("ENDCOLLECTIVE" in t
                                                              for t in body):
            continue
        # opcode without predicate and modifiers: LDS.U8 and LDS.128 both count as LDS
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                  for t in body)
        result.append((len(body), ops.most_common(top), ops["BAR"],
                       sum(n for op, n in ops.items() if op in ALU_OPS)))
    return result


# SASS opcodes that issue to the ALU pipe (the rest of the arithmetic, FFMA / FMUL / FADD /
# IMAD / VIADD, to the FMA pipe)
ALU_OPS = {"FSETP", "FSET", "FMNMX", "FSEL", "ISETP", "SEL", "LOP3", "SHF", "IADD3", "VIMNMX",
           "PLOP3", "LEA", "IABS", "PRMT", "FLO", "POPC", "BREV", "P2R", "R2P"}


def attention_resources(kv: str, sub: int, stages: int, warps: int, splits: int = 2,
                        sass: bool = False, tile: bool = False, qt: int = 4):
    kv_type = KV_TYPES[kv]
    pointers = dict(q_ptr="*bf16", k_ptr=kv_type, v_ptr=kv_type, idx_ptr="*i32",
                    out_ptr="*bf16", lse_ptr="*fp32", part_out_ptr="*fp32",
                    counter_ptr="*i32", tile_blocks_ptr="*i32",
                    blocks_ptr="*i32", union_ptr="*i32", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                    cu_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32")
    shared = dict(NUM_KV_HEADS=4, NUM_INDEX_HEADS=4, G=16, D=128, BLOCK=128, TOPK=16, KP=16,
                  SUB=sub, HAS_SCALE=False, IEEE=False, F16_COMPUTE=kv == "fp8")
    if tile:
        fn = _sparse_attention_tile_kernel
        # (the tile kernel reads the plan's union, not the selection or the block table)
        constexprs = {k: v for k, v in dict(shared, GP=16, QT=qt,
                                            PERSISTENT=False).items() if k in fn.arg_names}
    else:
        fn = _sparse_attention_kernel
        constexprs = dict(shared, NUM_HEADS=64, M=16, STEPS=16 * 128 // sub // splits,
                          SPLITS=splits, SP=1 << (splits - 1).bit_length(),
                          FUSED_MERGE=True, TILE_QT=0,
                          V_PAIRS=kv == "fp8" and os.environ.get("V_PAIRS", "1") == "1",
                          PTX=True,
                          LAZY_SUM=os.environ.get("LAZY_SUM", "0") == "1")
    constexprs.update({name: 1 for name in UNIT_STRIDES if name in fn.arg_names})
    return _compile(fn, constexprs, pointers, stages, warps, sass)


def index_resources(kv: str, rows: int, bps: int, stages: int, warps: int, sass: bool = False,
                    nan: bool = True, decode: bool = False):
    """The indexer's prefill launch (`TILE_MODE`) on M3's index shapes (4 heads of 128), or
    with `decode` its decode launch (keys as the MMA's rows, `rows` = 16 (token, head) rows)."""
    pointers = dict(q_ptr=KV_TYPES[kv], cache_ptr=KV_TYPES[kv], cu_ptr="*i32",
                    seq_lens_ptr="*i32", bt_ptr="*i32", out_ptr="*fp32")
    constexprs = dict(H=4, HP=4, DI=128, DIP=128, BLOCK=128, BPS=bps, SMALL_Q=16,
                      TILE_MODE=not decode, ROWS_T=rows // 4, CAST_K=False, IEEE=False,
                      KEYS_AS_ROWS=decode,
                      MAX_SKIPS_NAN=nan,
                      stride_qd=1, stride_cd=1, stride_btb=1, stride_ob=1)
    return _compile(_block_scores_kernel, constexprs, pointers, stages, warps, sass)


def select_resources(path: str, seg: int, cap: int, warps: int, chunk: int = 0,
                     single: bool = True, sass: bool = False):
    """The indexer's segment selection kernel: path 'search' (threshold, the many-program path)
    or 'sort' (bitonic), SEG blocks per program, a CAP-slot scratch row (0: none), read in
    chunks of `chunk` blocks (IndexerConfig's select.chunk; 0: whole); with `sass`, the loops
    holding a warp-wide sum (the search steps)."""
    from openmsa.ops.indexer.kernels.select import _segment_topk_kernel
    ptrs = dict(scores_ptr="*fp32", cu_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*i32",
                cand_ptr="*i64", scratch_ptr="*i64")
    # unit strides of a contiguous score tensor and output, as Triton specialises them at run
    # time (left as plain ints, every score's address is computed apart: ~20 more registers)
    constexprs = dict(TOPK=16, KP=16, INIT=0, LOCAL=1, BLOCK=128, SEG=seg, SINGLE=single,
                      BY_SORT=path == "sort", CAP=cap, NG=64, PDL=False, stride_sb=1,
                      stride_ok=1, CH=chunk)
    return _compile(_segment_topk_kernel, constexprs, ptrs, 1, warps, sass, marker=r"\bREDUX")


def merge_resources(which: str, arg: str, sass: bool = False):
    """The merge launches after a split: the attention's (`amerge`, SPLITS partials of 64 heads,
    under PDL) and the indexer's top-k merge (`tmerge`, segments' candidates, 'sort' or
    'search' path, under PDL)."""
    if which == "amerge":
        from openmsa.ops.attention.kernels.token import _merge_splits_kernel
        splits = int(arg)
        constexprs = dict(NUM_HEADS=64, D=128, SPLITS=splits, SP=1 << (splits - 1).bit_length(),
                          PDL=True, STORE_LSE=False, stride_od=1, stride_lh=1)
        ptrs = dict(part_out_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32")
        return _compile(_merge_splits_kernel, constexprs, ptrs, 1, 4, sass)
    from openmsa.ops.indexer.kernels.select import _merge_topk_kernel
    constexprs = dict(TOPK=16, KP=16, BLOCK=128, SEG=256, CANDP=64, BY_SORT=arg == "sort",
                      PDL=True, stride_ok=1)
    ptrs = dict(cand_ptr="*i64", cu_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*i32")
    return _compile(_merge_topk_kernel, constexprs, ptrs, 1, 4, sass)


def short_rows_resources(g: int, w: int, tpr: int, warps: int, sass: bool = False,
                         sort: bool = False):
    """The selection of short rows (select_rows.py, Gluon): G groups of W blocks per row, TPR
    threads per row, as plan.py launches it for an 8K chunk with no context (16-byte
    loads), rows sorted or searched; with `sass`, its search loop (the one whose counts cross
    threads: SHFL)."""
    from openmsa.ops.indexer.kernels.select_rows import _short_rows_topk_kernel
    ptrs = dict(scores_ptr="*fp32", cu_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*i32")
    constexprs = dict(H=4, TOPK=16, KP=16, INIT=0, LOCAL=1, BLOCK=128, G=g, W=w, VEC=4,
                      TPR=tpr, SORT=sort, stride_sb=1, stride_ok=1, num_warps=warps)
    return _compile(_short_rows_topk_kernel, constexprs, ptrs, 1, warps, sass,
                    marker=r"\bSHFL", gluon=True)


def nvfp4_resources(np_rows: int, sass: bool = False):
    """The Gluon NVFP4 decode launch (scores_nvfp4.py) as plan.py launches it at TP1 (4 index
    heads), NP (token, head) rows a pass, fp8 index query; with `sass`, its loops over ring units
    (the dequantization and the MMAs of a half block; with 8 rows two loops: the blocks needing no
    causal mask, two units an iteration, then the rest)."""
    from openmsa.ops.indexer.kernels.scores_nvfp4 import _nvfp4_decode_kernel
    from openmsa.ops.indexer.plan import DEFAULT
    form = DEFAULT.decode_nvfp4
    ptrs = dict(q_ptr="*fp8e4nv", cache_ptr="*u8", cu_ptr="*i32", seq_lens_ptr="*i32",
                bt_ptr="*i32", out_ptr="*fp32")
    constexprs = dict(H=4, NP=np_rows, BPS=form.max_bps, BLOCK=128, SMALL_Q=16,
                      PDL=True, STAGES=form.stages, stride_qd=1, stride_btb=1,
                      stride_ob=1)
    return _compile(_nvfp4_decode_kernel, constexprs, ptrs, 1, 1, sass, gluon=True,
                    maxnreg=form.maxnreg_8_rows if np_rows == 8 else None)


def prepare_scores_resources(ht: int, sass: bool = False):
    """The fused preparation + decode scoring launch (`prepare_and_select` on a short decode
    step: kernels/scores.py's _prepare_scores_kernel) for M3 at TP1 (64 q / 4 kv / 4 index
    heads, bf16 projection and K/V, fp8 index cache), `ht` heads per preparation tile, with
    the decode launch's constexprs (16 rows, 64 blocks a program, PDL) and unit strides."""
    from openmsa.ops.indexer.kernels.scores import _prepare_scores_kernel
    fp8, bf16 = "*fp8e4nv", "*bf16"
    pointers = dict(cache_ptr=fp8, out_ptr="*fp32", cu_ptr="*i32", seq_lens_ptr="*i32",
                    bt_ptr="*i32", qkv_ptr=bf16, pos_ptr="*i64", qw_ptr=bf16, kw_ptr=bf16,
                    iqw_ptr=bf16, ikw_ptr=bf16, table_ptr="*fp32", k_cache_ptr=bf16,
                    v_cache_ptr=bf16, slot_ptr="*i64", index_slot_ptr="*i64",
                    k_scale_ptr="*fp32", v_scale_ptr="*fp32", q_out_ptr=bf16, iq_out_ptr=fp8)
    constexprs = dict(H=4, HP=4, DI=128, DIP=128, BLOCK=128, BPS=64, SMALL_Q=16, ROWS_T=4,
                      CAST_K=False, IEEE=False, KEYS_AS_ROWS=True, MAX_SKIPS_NAN=True, PDL=True,
                      HQ=64, HKV=4, D=128, DP=128, ROT=64, NCOARSE=16384,
                      FP32_ANGLES=False, ROPE_SCALE=1.0, KV_BLOCK=128, HT=ht,
                      KV_SATURATE=False, INDEX_SATURATE=True, IQ_SATURATE=True, HAS_SCALE=False,
                      PREP_TILES=7, stride_cd=1, stride_btb=1, stride_ob=1, stride_xc=1,
                      stride_id=1, stride_qd=1, stride_kcd=1, stride_vcd=1)
    return _compile(_prepare_scores_kernel, constexprs, pointers, 3, 4, sass,
                    scalars=dict(eps="fp32"))


def _compile(fn, constexprs, pointers, stages, warps, sass, marker=r"\b[HQ]?G?MMA",
             gluon=False, maxnreg=None, scalars=None):
    # maxnreg: the launch's own register cap (MAXNREG in the environment overrides it)
    # constexpr parameters left out take their defaults (as in a launch that does not pass
    # them), not a run-time int
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
                  **constexprs}
    signature = {name: "constexpr" if name in constexprs
                 else pointers.get(name) or (scalars or {}).get(name)
                 or ("fp32" if name == "sm_scale" else "i32")
                 for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in constexprs and (name in pointers or name.startswith("stride"))}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(fn, signature,
                             {(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs)
    else:
        src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages,
                                           **({"maxnreg": int(os.environ["MAXNREG"])}
                                              if os.environ.get("MAXNREG") else
                                              {"maxnreg": maxnreg} if maxnreg else {})))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        cubin = os.path.join(tmp, "k.o")
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        mix = None
        if sass:
            dump = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"),
                                   "--dump-sass", cubin], capture_output=True, text=True,
                                  check=True).stdout
            mix = _loop_mix(dump, marker=marker)
            if os.environ.get("SASS_DUMP"):  # the whole SASS, to read a loop line by line
                with open(os.environ["SASS_DUMP"], "w") as f:
                    f.write(dump)
                # and Triton's layout-annotated IR beside it (where convert_layout sits)
                with open(os.environ["SASS_DUMP"] + ".ttgir", "w") as f:
                    f.write(compiled.asm["ttgir"])
    regs = int(info.split("Used ")[1].split(" registers")[0])
    spills = info.split("bytes spill stores")[0].rsplit(",", 1)[-1].strip()
    smem = compiled.metadata.shared
    per_sm = min(65536 // (-(-regs // 8) * 8 * 32 * warps), 233472 // (smem + 1024))
    return regs, int(spills), smem, per_sm, mix


def _print_loops(mix):
    for count, ops, bars, alu in mix or []:
        # each BAR stalls the whole program until its slowest warp arrives
        print(f"      loop: {count} instructions per warp per iteration ({alu} on the ALU "
              f"pipe), {bars} BAR; {ops}")


if __name__ == "__main__":
    args = sys.argv[1:]
    want_sass = "--sass" in args
    args = [a for a in args if a != "--sass"]
    print("kernel kv    sub stages warps  registers spill_bytes smem_KB programs/SM")
    for arg in args or ["fp8,128,3,4", "fp8,64,3,4", "bf16,128,3,4", "bf16,64,3,4"]:
        if arg.startswith(("index:", "idec:")):
            kv, rows, bps, stages, warps = arg.split(":")[1].split(",")
            regs, spills, smem, per_sm, mix = index_resources(kv, int(rows), int(bps),
                                                              int(stages), int(warps),
                                                              sass=want_sass,
                                                              decode=arg.startswith("idec:"))
            print(f"{arg[:4]:6s} {kv:5s} rows {rows} bps {bps} {stages:>6s} {warps:>5s}  {regs:9d} "
                  f"{spills:11d} {smem / 1024:7.1f} {per_sm:12d}", flush=True)
            _print_loops(mix)
            continue
        if arg.startswith("prep:"):
            ht = int(arg.split(":")[1])
            regs, spills, smem, per_sm, mix = prepare_scores_resources(ht, sass=want_sass)
            print(f"prep   fp8   HT {ht:<3d} {3:>8d} {4:>5d}  {regs:9d} {spills:11d} "
                  f"{smem / 1024:7.1f} {min(per_sm, 32):12d}", flush=True)
            _print_loops(mix)
            continue
        if arg.startswith("nvfp4:"):
            np_rows = int(arg.split(":")[1])
            regs, spills, smem, per_sm, mix = nvfp4_resources(np_rows, sass=want_sass)
            print(f"nvfp4  NP {np_rows} {1:>17d}  {regs:9d} {spills:11d} {smem / 1024:7.1f} "
                  f"{min(per_sm, 32):12d}", flush=True)
            _print_loops(mix)
            continue
        if arg.startswith("rows:"):
            g, w, tpr, warps, *more = arg.split(":")[1].split(",")
            regs, spills, smem, per_sm, mix = short_rows_resources(
                int(g), int(w), int(tpr), int(warps), sass=want_sass,
                sort=bool(more) and more[0] == "sort")
            print(f"rows   G {g} W {w} tpr {tpr} {warps:>5s}  {regs:9d} {spills:11d} "
                  f"{smem / 1024:7.1f} {min(per_sm, 32):12d}", flush=True)
            _print_loops(mix)
            continue
        if arg.startswith(("amerge:", "tmerge:")):
            which, what = arg.split(":")
            regs, spills, smem, per_sm, mix = merge_resources(which, what, sass=want_sass)
            print(f"{which:6s} {what:15s} {1:>5d} {4:>5d}  {regs:9d} {spills:11d} "
                  f"{smem / 1024:7.1f} {min(per_sm, 32):12d}", flush=True)
            _print_loops(mix)
            continue
        if arg.startswith("sel:"):
            path, seg, cap, warps, *more = arg.split(":")[1].split(",")
            regs, spills, smem, per_sm, mix = select_resources(
                path, int(seg), int(cap), int(warps), int(more[0]) if more else 0,
                sass=want_sass)
            # Hopper also caps a multiprocessor at 32 programs
            print(f"sel    {path:6s} seg {seg} cap {cap} {warps:>5s}  {regs:9d} {spills:11d} "
                  f"{smem / 1024:7.1f} {min(per_sm, 32):12d}", flush=True)
            _print_loops(mix)
            continue
        tile = arg.startswith("tile")
        qt = int(arg[4:arg.index(":")] or 4) if tile else 4
        kv, sub, stages, warps = arg.split(":")[-1].split(",")
        regs, spills, smem, per_sm, mix = attention_resources(kv, int(sub), int(stages),
                                                              int(warps), sass=want_sass,
                                                              tile=tile, qt=qt)
        print(f"{f'tile{qt}' if tile else 'token':6s} {kv:5s} {sub:>3s} {stages:>6s} {warps:>5s}  "
              f"{regs:9d} {spills:11d} "
              f"{smem / 1024:7.1f} {per_sm:12d}", flush=True)
        _print_loops(mix)
