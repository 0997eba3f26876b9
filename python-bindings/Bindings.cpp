//===- Bindings.cpp - The _megaslide Python extension ---------------------===//
//
// Thin wrappers over the C API; argument checking beyond types and the
// dict-shaped results live in megaslide/__init__.py.
//
//===----------------------------------------------------------------------===//

#include "megaslide/CAPI/MegaSlide.h"

#include <pybind11/pybind11.h>

#include <memory>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

using OwnedString = std::unique_ptr<char, decltype(&megaslideFreeString)>;

std::string modelInfoJson(const std::string &model, int64_t frames,
                          int64_t height, int64_t width, bool latent,
                          int64_t batch, int64_t textLen) {
  char *json = nullptr, *error = nullptr;
  int rc = megaslideModelInfoJson(model.c_str(), frames, height, width, latent,
                                  batch, textLen, &json, &error);
  OwnedString jsonOwner(json, megaslideFreeString);
  OwnedString errorOwner(error, megaslideFreeString);
  if (rc != 0)
    throw std::invalid_argument(error);
  return json;
}

std::string planJson(const std::string &model, int64_t frames, int64_t height,
                     int64_t width, bool latent, int64_t batch,
                     int64_t textLen, const std::string &options) {
  char *json = nullptr, *error = nullptr;
  int rc = megaslidePlanJson(model.c_str(), frames, height, width, latent,
                             batch, textLen, options.c_str(), &json, &error);
  OwnedString jsonOwner(json, megaslideFreeString);
  OwnedString errorOwner(error, megaslideFreeString);
  if (rc != 0)
    throw std::invalid_argument(error);
  return json;
}

} // namespace

PYBIND11_MODULE(_megaslide, m) {
  m.doc() = "Native core of the megaslide package (use `import megaslide`).";
  m.attr("__version__") = megaslideVersion();
  m.def("model_info_json", &modelInfoJson, py::arg("model"), py::arg("frames"),
        py::arg("height"), py::arg("width"), py::arg("latent"),
        py::arg("batch"), py::arg("text_len"),
        "JSON text of the model part of megaslide-plan --format json.");
  m.def("plan_json", &planJson, py::arg("model"), py::arg("frames"),
        py::arg("height"), py::arg("width"), py::arg("latent"),
        py::arg("batch"), py::arg("text_len"), py::arg("options"),
        "JSON text of megaslide-plan --format json.");
}
