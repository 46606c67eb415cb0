// kvserve_native.CompiledPackage: an AOTInductor package (models/compiled_program.py) run through a
// torchbind class, whose methods Python calls without holding the GIL, unlike torch's own binding.
#include <torch/custom_class.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

namespace {

struct CompiledPackage : torch::CustomClassHolder {
  torch::inductor::AOTIModelPackageLoader loader;

  explicit CompiledPackage(const std::string& path) : loader(path) {}

  std::vector<std::string> constant_fqns() { return loader.get_constant_fqns(); }

  // The program's own tensors, used where they lie (no copy): they must outlive the package.
  void use_constants(const c10::Dict<std::string, at::Tensor>& tensors) {
    std::unordered_map<std::string, at::Tensor> map;
    for (const auto& e : tensors) map.emplace(e.key(), e.value());
    loader.load_constants(map, /*use_inactive=*/false, /*check_full_update=*/true, /*user_managed=*/true);
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) { return loader.run(inputs); }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_native, m) {
  m.class_<CompiledPackage>("CompiledPackage")
      .def(torch::init<std::string>())
      .def("constant_fqns", &CompiledPackage::constant_fqns)
      .def("use_constants", &CompiledPackage::use_constants)
      .def("run", &CompiledPackage::run);
}
