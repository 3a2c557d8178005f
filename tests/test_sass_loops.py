"""bench/sass_loops.py's reading of nvdisasm output (the counting needs no toolkit: a written listing)."""
from bench import sass_loops as L

LISTING = """
        .section	.text.kern_a,"ax",@progbits
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_3:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR6][R2.64] ;
        /*0020*/                   LDSM.16.M88.4 R8, [R9] ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0050*/               @P0 BRA `(.L_x_3) ;
        /*0060*/                   EXIT ;
        .section	.text.kern_b,"ax",@progbits
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_9:
        /*0010*/                   LDS R4, [R3] ;
        /*0020*/                   BRA `(.L_x_10) ;
.L_x_10:
        /*0030*/               @P1 BRA `(.L_x_9) ;
"""


def test_a_loop_holding_mma_is_counted_to_its_last_mma():
    fns = L.functions(LISTING)
    assert set(fns) == {"kern_a", "kern_b"}
    ins, labels = fns["kern_a"]
    assert len(ins) == 7 and labels == {".L_x_3": 1}
    (loop,) = L.mma_loops(ins, labels)
    to_mma, body, kinds = loop
    assert (to_mma, body) == (3, 5)
    assert kinds["HMMA"] == 1 and kinds["LDGSTS"] == 1 and kinds["LDSM"] == 1 and kinds["BRA"] == 0
    # a predicated instruction counts under its opcode
    assert L._op("@P0 BRA `(.L_x_3)") == "BRA"


def test_loops_without_mma_and_forward_branches_are_not_reported():
    ins, labels = L.functions(LISTING)["kern_b"]
    assert L.mma_loops(ins, labels) == []
