"""bench/sass.py: the SASS counter (on cuobjdump's own output), its table, and, where TileLang,
nvcc and a disassembler are installed (not in CI), the routed experts' one-token kernel compiled
for the H200: 2,048 instructions a warp, 128 of them on the tensor cores (docs/performance-log.md,
2026-12-01 02:34)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from bench import sass

# `cuobjdump -sass` of kernels/fp4_mma_one_token.py's routed w1|w3 kernel, a few of its lines:
# every instruction line is followed by a line holding the rest of its encoding
SNIPPET = """
	code for sm_90a
	.target	sm_90a

		Function : fp4_mma1_kernel
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                 /* 0x00000a00ff017b82 */
                                                                                          /* 0x000ff00000000800 */
        /*0010*/                   S2UR UR8, SR_CTAID.Y ;                                 /* 0x00000000000879c3 */
                                                                                          /* 0x000e220000002600 */
        /*0020*/                   ULDC.64 UR4, c[0x0][0x210] ;                           /* 0x0000840000047ab9 */
                                                                                          /* 0x000fe20000000a00 */
        /*0dd0*/                   HMMA.16816.F32 R64, R64, R40.reuse, RZ ;               /* 0x000000284040723c */
                                                                                          /* 0x081fec00000018ff */
        /*0de0*/                   HMMA.16816.F32 R44, R44, R40, RZ ;                     /* 0x000000282c2c723c */
                                                                                          /* 0x000fee00000018ff */
        /*7e60*/              @!P0 STG.E.U16 desc[UR10][R2.64], R4 ;                      /* 0x0000000402008986 */
                                                                                          /* 0x000fe2000c10150a */
        /*79c0*/               @P0 EXIT ;                                                 /* 0x000000000000094d */
                                                                                          /* 0x000fc00000000000 */
        /*7ff0*/                   NOP;                                                   /* 0x0000000000007918 */
                                                                                          /* 0x000fc00000000000 */
		..........


"""


def test_instructions_are_counted_by_opcode_with_predicates_and_modifiers_dropped():
    c = sass.count_sass(SNIPPET)
    assert c.opcodes == {"LDC": 1, "S2UR": 1, "ULDC": 1, "HMMA": 2, "STG": 1, "EXIT": 1, "NOP": 1}
    assert (c.instructions, c.nops, c.tensor_core) == (8, 1, 2)
    assert sass.count_sass("code for sm_90a\n\t\t..........\n").instructions == 0


def test_the_table_gives_instructions_per_weight_byte_a_warp_reads():
    c = sass.count_sass(SNIPPET)
    text = sass.table({"routed w1|w3": (c, 16)}, opcodes=2)
    assert "| routed w1|w3 | 8 | 1 | 2 | 0.500 | HMMA 2, LDC 1 |" in text


def test_bad_arguments_are_refused_with_the_fix(monkeypatch):
    with pytest.raises(SystemExit, match="--arch takes MAJOR.MINOR"):
        sass.main(["--arch", "sm90"])
    monkeypatch.setattr(sass.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    if importlib.util.find_spec("nvidia") is None:
        with pytest.raises(SystemExit, match="pip install nvidia-cuda-nvdisasm"):
            sass.find_disassembler()


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None or (
    not any(map(shutil.which, ("nvdisasm", "cuobjdump"))) and importlib.util.find_spec("nvidia") is None),
    reason="needs TileLang, nvcc and nvdisasm or cuobjdump (no GPU)")
def test_the_routed_experts_kernel_compiles_to_its_logged_count(capsys):
    assert sass.main(["--kernel", "routed w1|w3", "--opcodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "| routed w1|w3 | 2,048 | " in out and " | 128 | 0.125 | " in out
