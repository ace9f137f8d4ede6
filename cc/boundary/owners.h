/* tf-ophandlers C++ boundary: small owners of Python references and TensorFlow C API
   objects (internal header), so that every exit of a function releases what it holds
   without `goto` cleanups.

   - PyRef owns one strong reference to a PyObject (or nothing). Constructed from a new
     reference (it steals it, null allowed: a failed call); PyRef::Borrow(o) takes a new
     reference to a borrowed `o`. Destroying or resetting it releases the reference
     (Py_XDECREF), so the GIL must be held wherever a non-empty PyRef dies or is reset.
     release() hands the reference to the caller (for a function returning a new
     reference, or a "steals" API such as PyList_SET_ITEM). Move-only.
   - StatusPtr, HandlePtr, OpPtr: std::unique_ptr with the TensorFlow C API's deleters
     (TF_DeleteStatus, TFE_DeleteTensorHandle, TFE_DeleteOp). No GIL needed by any of
     them (TensorFlow's own objects).

   Ownership and GIL contracts of the functions that use them are unchanged: an owner
   only makes the release that the contract already required automatic.
*/
#ifndef TF_OPHANDLERS_BOUNDARY_OWNERS_H_
#define TF_OPHANDLERS_BOUNDARY_OWNERS_H_

#include <Python.h>

#include <memory>

#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"

namespace tf_ophandlers {

class PyRef {
 public:
  PyRef() = default;
  // Steals `o` (a new reference, or null).
  explicit PyRef(PyObject* o) : o_(o) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  PyRef(PyRef&& other) noexcept : o_(other.release()) {}
  PyRef& operator=(PyRef&& other) noexcept {
    reset(other.release());
    return *this;
  }
  ~PyRef() { Py_XDECREF(o_); }

  // A new reference to the borrowed `o` (null allowed).
  static PyRef Borrow(PyObject* o) {
    Py_XINCREF(o);
    return PyRef(o);
  }

  PyObject* get() const { return o_; }
  explicit operator bool() const { return o_ != nullptr; }
  // Gives up ownership: the caller owns the returned reference.
  PyObject* release() {
    PyObject* o = o_;
    o_ = nullptr;
    return o;
  }
  // Releases the held reference (if any) and steals `o`. The old reference is released
  // after the new one is stored, as Py_XSETREF does (its destructor may run Python).
  void reset(PyObject* o = nullptr) {
    PyObject* old = o_;
    o_ = o;
    Py_XDECREF(old);
  }

 private:
  PyObject* o_ = nullptr;
};

struct StatusDeleter {
  void operator()(TF_Status* s) const { TF_DeleteStatus(s); }
};
struct HandleDeleter {
  void operator()(TFE_TensorHandle* h) const { TFE_DeleteTensorHandle(h); }
};
struct OpDeleter {
  void operator()(TFE_Op* op) const { TFE_DeleteOp(op); }
};
using StatusPtr = std::unique_ptr<TF_Status, StatusDeleter>;
using HandlePtr = std::unique_ptr<TFE_TensorHandle, HandleDeleter>;
using OpPtr = std::unique_ptr<TFE_Op, OpDeleter>;

}  // namespace tf_ophandlers

#endif  // TF_OPHANDLERS_BOUNDARY_OWNERS_H_
