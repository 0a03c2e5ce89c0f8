"""benchmarks/matvec_forms.py on CPU: every form computes the model's output projection, and the
HLO classifier names what XLA made of the dot (GPU-style texts written by hand)."""

from benchmarks import matvec_forms


def test_every_form_is_the_models_projection():
  recs = matvec_forms.time_forms(1, 1.0, (("tiny", 4, 16, 64),))
  assert [r["form"] for r in recs] == list(matvec_forms.FORMS)
  for r in recs:
    assert r["max_abs_err"] < 0.1, r  # bf16 output of sums of 64 products ~N(0, 1)
    assert r["us"] > 0


def test_compiled_as_names_the_dots_form():
  gemm = "%gemm_fusion_dot.3 = bf16[1,4096] fusion(%p0, %p1), kind=kCustom, calls=%f"
  cublas = ('%custom-call.1 = (bf16[1,4096], s8[0]) custom-call(%a, %b), '
            'custom_call_target="__cublas$gemm"')
  reduce = ("%multiply.2 = f32[2048,4096] multiply(%b, %w)\n"
            "%reduce.1 = f32[4096] reduce(%multiply.2, %c), dimensions={0}, to_apply=%add")
  assert matvec_forms.compiled_as(gemm) == "gemm"
  assert matvec_forms.compiled_as(cublas) == "gemm"
  assert matvec_forms.compiled_as(reduce) == "reduce"
  assert matvec_forms.compiled_as("%dot.1 = f32[1,64] dot(%a, %b)") == "dot"
