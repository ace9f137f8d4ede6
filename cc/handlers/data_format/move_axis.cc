// tf-ophandlers: OhMoveAxis, the one data move oh.DataFormat adds to a replayed
// channels-first function (its NCHW input to NHWC), as a kernel cheaper than
// TensorFlow's Transpose for it (Eigen's shuffle pays an index computation per element
// when the inner dimension is a 3-channel image's).
//
// OhMoveAxis(x: T, to_last: bool) -> y
//   to_last:  y = transpose(x, [0, 2, ..., r-1, 1])   (axis 1 to the end: NC... -> N...C)
//   !to_last: y = transpose(x, [0, r-1, 1, ..., r-2]) (the last axis to 1: N...C -> NC...)
// for rank r >= 3. Seen as [N, A, B] (A = dim 1 and B = the product of the others for
// to_last; A = the product of dims 1..r-2 and B = the last dim otherwise), every batch
// item is a 2-D transpose [A, B] -> [B, A]. The gradient (tf_ophandlers/core/move_axis.py)
// is the move the other way. Used only inside the replay cache's functions, which stay
// in the process: graphs users may export keep tf.transpose (TensorFlow Serving loads
// them without this library).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/util/work_sharder.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace tf_ophandlers {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace si = ::tensorflow::shape_inference;

REGISTER_OP("OhMoveAxis")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: type")
    .Attr("to_last: bool")
    .SetShapeFn([](si::InferenceContext* c) {
      si::ShapeHandle in;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 3, &in));
      if (!c->RankKnown(in)) {  // (Rank() is -1 then: no dims to move)
        c->set_output(0, c->UnknownShape());
        return ::tensorflow::OkStatus();
      }
      bool to_last;
      TF_RETURN_IF_ERROR(c->GetAttr("to_last", &to_last));
      const int r = c->Rank(in);
      std::vector<si::DimensionHandle> dims;
      dims.push_back(c->Dim(in, 0));
      if (to_last) {
        for (int k = 2; k < r; ++k) dims.push_back(c->Dim(in, k));
        dims.push_back(c->Dim(in, 1));
      } else {
        dims.push_back(c->Dim(in, r - 1));
        for (int k = 1; k < r - 1; ++k) dims.push_back(c->Dim(in, k));
      }
      c->set_output(0, c->MakeShape(dims));
      return ::tensorflow::OkStatus();
    })
    .Doc("transpose(x, [0, 2, ..., r-1, 1]) (to_last) or transpose(x, [0, r-1, 1, ..., "
         "r-2]) (tf-ophandlers; in-process functions only).");

// out[b, a] = in[a, b] for an [A, B] matrix of elements E, in tiles that keep both
// sides' lines in cache; a few rows or columns (a 3-channel image) go directly, reading
// or writing a few streams.
#if defined(__SSE2__)
// The 3-channel image's move of 4-byte elements: rows x, y, z -> x0 y0 z0 x1 y1 z1 ...,
// four columns per step in SSE2 registers (x86-64's baseline). The element loop below
// reads three streams and writes one an element at a time; this one runs several times
// faster (the whole move is a few percent of a small CNN's replayed call).
void Interleave3(const uint32_t* in, uint32_t* out, int64_t B) {
  const float* x_row = reinterpret_cast<const float*>(in);
  const float* y_row = x_row + B;
  const float* z_row = y_row + B;
  float* o = reinterpret_cast<float*>(out);
  int64_t b = 0;
  for (; b + 4 <= B; b += 4, o += 12) {
    // Only shuffles and unaligned loads/stores: the bits move unchanged (no arithmetic,
    // so NaN payloads and integer bit patterns survive).
    const __m128 x = _mm_loadu_ps(x_row + b), y = _mm_loadu_ps(y_row + b),
                 z = _mm_loadu_ps(z_row + b);
    const __m128 xy01 = _mm_unpacklo_ps(x, y);  // x0 y0 x1 y1
    const __m128 xy23 = _mm_unpackhi_ps(x, y);  // x2 y2 x3 y3
    const __m128 zx01 = _mm_unpacklo_ps(z, x);  // z0 x0 z1 x1
    const __m128 zx23 = _mm_unpackhi_ps(z, x);  // z2 x2 z3 x3
    const __m128 yz01 = _mm_unpacklo_ps(y, z);  // y0 z0 y1 z1
    const __m128 yz23 = _mm_unpackhi_ps(y, z);  // y2 z2 y3 z3
    _mm_storeu_ps(o, _mm_shuffle_ps(xy01, zx01, _MM_SHUFFLE(3, 0, 1, 0)));      // x0 y0 z0 x1
    _mm_storeu_ps(o + 4, _mm_shuffle_ps(yz01, xy23, _MM_SHUFFLE(1, 0, 3, 2)));  // y1 z1 x2 y2
    _mm_storeu_ps(o + 8, _mm_shuffle_ps(zx23, yz23, _MM_SHUFFLE(3, 2, 3, 0)));  // z2 x3 y3 z3
  }
  for (; b < B; ++b) {
    out[b * 3] = in[b];
    out[b * 3 + 1] = in[B + b];
    out[b * 3 + 2] = in[2 * B + b];
  }
}
#endif

template <typename E>
void Transpose2D(const E* in, E* out, int64_t A, int64_t B) {
#if defined(__SSE2__)
  if constexpr (sizeof(E) == 4) {
    if (A == 3) return Interleave3(in, out, B);
  }
#endif
  if (A <= 4) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t a = 0; a < A; ++a) out[b * A + a] = in[a * B + b];
    return;
  }
  if (B <= 4) {
    for (int64_t a = 0; a < A; ++a)
      for (int64_t b = 0; b < B; ++b) out[b * A + a] = in[a * B + b];
    return;
  }
  constexpr int64_t kTile = 32;
  for (int64_t a0 = 0; a0 < A; a0 += kTile) {
    const int64_t a1 = std::min(A, a0 + kTile);
    for (int64_t b0 = 0; b0 < B; b0 += kTile) {
      const int64_t b1 = std::min(B, b0 + kTile);
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t a = a0; a < a1; ++a) out[b * A + a] = in[a * B + b];
    }
  }
}

template <typename E>
void Run(OpKernelContext* ctx, const Tensor& x, Tensor* y, int64_t N, int64_t A, int64_t B) {
  const E* in = reinterpret_cast<const E*>(x.tensor_data().data());
  E* out = reinterpret_cast<E*>(const_cast<char*>(y->tensor_data().data()));
  const int64_t item = A * B;
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) Transpose2D(in + n * item, out + n * item, A, B);
  };
  // Below 1 MiB (the benchmark's 16x3x56x56 float input is 0.6 MiB) one thread: waking
  // the pool's threads cost more process time than they saved (loaded 2-core machine).
  if (N < 2 || item * N * static_cast<int64_t>(sizeof(E)) < (int64_t{1} << 20)) {
    work(0, N);
    return;
  }
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
  ::tensorflow::Shard(pool->num_threads, pool->workers, N, item * 2 * sizeof(E), work);
}

class MoveAxisKernel : public OpKernel {
 public:
  explicit MoveAxisKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("to_last", &to_last_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const int r = x.dims();
    OP_REQUIRES(ctx, r >= 3,
                ::tensorflow::errors::InvalidArgument(
                    "OhMoveAxis: the input must have rank >= 3, got shape ",
                    x.shape().DebugString()));
    OP_REQUIRES(ctx, ::tensorflow::DataTypeCanUseMemcpy(x.dtype()),
                ::tensorflow::errors::InvalidArgument(
                    "OhMoveAxis: dtype ", ::tensorflow::DataTypeString(x.dtype()),
                    " is not a plain-memory type"));
    TensorShape shape;
    shape.AddDim(x.dim_size(0));
    int64_t A = 1, B = 1;
    if (to_last_) {
      A = x.dim_size(1);
      for (int k = 2; k < r; ++k) {
        shape.AddDim(x.dim_size(k));
        B *= x.dim_size(k);
      }
      shape.AddDim(A);
    } else {
      B = x.dim_size(r - 1);
      shape.AddDim(B);
      for (int k = 1; k < r - 1; ++k) {
        shape.AddDim(x.dim_size(k));
        A *= x.dim_size(k);
      }
    }
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &y));
    const int64_t N = x.dim_size(0);
    if (x.NumElements() == 0) return;
    switch (::tensorflow::DataTypeSize(x.dtype())) {
      case 1: return Run<uint8_t>(ctx, x, y, N, A, B);
      case 2: return Run<uint16_t>(ctx, x, y, N, A, B);
      case 4: return Run<uint32_t>(ctx, x, y, N, A, B);
      case 8: return Run<uint64_t>(ctx, x, y, N, A, B);
      case 16: {  // complex128: two 8-byte halves moved together
        struct P { uint64_t lo, hi; };
        return Run<P>(ctx, x, y, N, A, B);
      }
      default:
        ctx->CtxFailure(::tensorflow::errors::InvalidArgument(
            "OhMoveAxis: unsupported element size for dtype ",
            ::tensorflow::DataTypeString(x.dtype())));
    }
  }

 private:
  bool to_last_ = true;
};

REGISTER_KERNEL_BUILDER(Name("OhMoveAxis").Device(::tensorflow::DEVICE_CPU), MoveAxisKernel);

}  // namespace
}  // namespace tf_ophandlers
