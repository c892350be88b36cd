"""Model serving: the model catalog, GGUF metadata, and the inference engine."""

from appliance.serving.llama_package import install

# Before any module here imports llama_cpp: its C API now, its high-level half on first use.
install()
