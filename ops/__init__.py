"""The toolbox: `setup`, `serve` and `test` (the commands), deploy/ (the image and the Kubernetes
manifests), bench/ (the benchmarks, a package: `python -m ops.bench.<module>` from the repository
root) and device/ (the harness for the GPU machine). Not part of the wheel."""
