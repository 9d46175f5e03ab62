// The coat operator library: every schema in one place, and the Python module that loads it.
// Kernels are registered per family (quantize.cpp, adamw.cpp, ...); fake implementations live beside the Python
// ops, in the family's module of coat/ops/.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(coat, m) {
  m.def("quantize_group(Tensor x, int group_size, ScalarType fp8_dtype, bool transpose=False)"
        " -> (Tensor q, Tensor scales, Tensor q_t)");
  m.def("group_amax(Tensor x, int group_size) -> Tensor");
  m.def("quantize_tensor(Tensor x, Tensor group_amax, ScalarType fp8_dtype, bool transpose=False)"
        " -> (Tensor q, Tensor scale, Tensor q_t)");
  m.def("tensor_amax(Tensor[] xs) -> Tensor");
  m.def("quantize_tensors(Tensor[] xs, int dim, Tensor amax, ScalarType fp8_dtype, bool rowwise, bool columnwise)"
        " -> (Tensor q, Tensor scale, Tensor q_t)");
  m.def("dequantize(Tensor q, Tensor scale, int? group_size, ScalarType dtype) -> Tensor");
  m.def("quantize_fp4(Tensor x, int block_size) -> (Tensor codes, Tensor scales)");
  m.def("dequantize_fp4(Tensor codes, Tensor scales, int cols, int block_size, ScalarType dtype) -> Tensor");
  m.def("fp4_to_e4m3(Tensor codes, Tensor scales, int cols, int block_size) -> Tensor");
  m.def("quantize_fp6(Tensor x, int block_size) -> (Tensor codes, Tensor scales)");
  m.def("dequantize_fp6(Tensor codes, Tensor scales, int cols, int block_size, ScalarType dtype) -> Tensor");
  m.def("fp6_to_e4m3(Tensor codes, Tensor scales, int cols, int block_size) -> Tensor");
  m.def("rmsnorm_quantize(Tensor x, Tensor weight, float eps, int save_group_size, int amax_group_size,"
        " ScalarType fp8_dtype, bool transpose, str save_format='e4m3', float weight_offset=0.0)"
        " -> (Tensor y, Tensor y_scale, Tensor y_t, Tensor x_saved, Tensor x_saved_scales, Tensor rstd)");
  m.def("rmsnorm_backward(Tensor dy, Tensor x_saved, Tensor x_saved_scales, Tensor rstd, Tensor weight,"
        " int save_group_size, Tensor? residual=None, str saved_format='e4m3', float weight_offset=0.0)"
        " -> (Tensor dx, Tensor dweight)");
  m.def("rmsnorm_save(Tensor x, Tensor weight, float eps, int save_group_size, Tensor? residual=None,"
        " str save_format='e4m3', float weight_offset=0.0)"
        " -> (Tensor out, Tensor x_saved, Tensor x_saved_scales, Tensor rstd)");
  m.def("silu_mul_quantize(Tensor gate, Tensor? up, Tensor? smooth_scale, int save_group_size, int amax_group_size,"
        " ScalarType fp8_dtype, bool transpose, str save_format='e4m3', str activation='silu')"
        " -> (Tensor y, Tensor y_scale, Tensor y_t, Tensor gate_saved, Tensor gate_scales, Tensor up_saved,"
        " Tensor up_scales)");
  m.def("silu_mul_backward(Tensor dy, Tensor gate_saved, Tensor gate_scales, Tensor? up_saved, Tensor? up_scales,"
        " Tensor? smooth_scale, int save_group_size, str saved_format='e4m3', str activation='silu')"
        " -> (Tensor dgate, Tensor dup, Tensor d_amax)");
  m.def("rmsnorm_requantize(Tensor x_saved, Tensor x_saved_scales, Tensor rstd, Tensor weight, Tensor y_scale,"
        " int save_group_size, ScalarType fp8_dtype, str saved_format='e4m3', float weight_offset=0.0) -> Tensor");
  m.def("silu_mul_requantize(Tensor gate_saved, Tensor gate_scales, Tensor? up_saved, Tensor? up_scales,"
        " Tensor? smooth_scale, Tensor y_scale, int save_group_size, ScalarType fp8_dtype, str saved_format='e4m3',"
        " int? cols=None, str activation='silu') -> Tensor");
  m.def("fp8_adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_metas,"
        " Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] exp_avg_sq_metas, float beta1, float beta2, float eps,"
        " float decay_factor, float step_size, float bias_correction2_sqrt, int group_size, bool expand_m,"
        " bool expand_v, int[]? rounding_seeds=None) -> ()");
  m.def("quantize_expanded(Tensor x, int group_size, ScalarType fp8_dtype, bool expand) -> (Tensor codes, Tensor meta)");
  m.def("dequantize_expanded(Tensor codes, Tensor meta, int group_size) -> Tensor");
  m.def("moment_stats(Tensor[] codes, Tensor[] metas, int group_size, Tensor?[] rows) -> Tensor");
  m.def("quantization_sums_(Tensor(a!)[] sums, Tensor[] x, Tensor[] q, Tensor[] scale, int[] group_size,"
        " Tensor?[] rows, bool[] x_holds_measured_rows, float[] amax_per_scale) -> ()");
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin, bool inverse=False)"
        " -> (Tensor q_out, Tensor k_out)");
  m.def("cross_entropy(Tensor(a!) logits, Tensor labels, Tensor? grad_scale, int ignore_index, float label_smoothing,"
        " float softcap, float z_loss) -> (Tensor loss, Tensor lse)");
  m.def("qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, Tensor cos, Tensor sin,"
        " int save_group_size, float weight_offset=0.0) -> (Tensor q_out, Tensor k_out,"
        " Tensor q_saved, Tensor q_saved_scales, Tensor q_rstd,"
        " Tensor k_saved, Tensor k_saved_scales, Tensor k_rstd)");
}

static PyObject* coat_built_with_cuda(PyObject*, PyObject*) {
#ifdef COAT_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

// setup.py defines these from the torch it builds against; coat/_native.py compares them with the running one.
#ifndef COAT_TORCH_VERSION
#error "COAT_TORCH_VERSION is undefined: build coat with setup.py (pip install --no-build-isolation -v .)"
#endif
#ifndef COAT_TORCH_CUDA_VERSION
#define COAT_TORCH_CUDA_VERSION nullptr  // a torch without CUDA (torch.version.cuda is None)
#endif

static PyObject* coat_built_against_torch(PyObject*, PyObject*) {
  return Py_BuildValue("(sz)", COAT_TORCH_VERSION, COAT_TORCH_CUDA_VERSION);
}

static PyMethodDef coat_methods[] = {
    {"built_with_cuda", coat_built_with_cuda, METH_NOARGS, "Whether the CUDA kernels were compiled in."},
    {"built_against_torch", coat_built_against_torch, METH_NOARGS,
     "(torch.__version__, torch.version.cuda) of the torch the extension was compiled against."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef coat_module = {PyModuleDef_HEAD_INIT, "_C", "coat native operators", -1, coat_methods};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&coat_module); }
