"""Bringing model files to the hub: references (`hf://…`, `https://…`), the Hugging Face
Hub's protocol for resolving one to a pinned commit and files with their digests, and
downloads that resume and are checked against those digests before the hub keeps them."""
