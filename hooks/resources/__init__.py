"""Resource layer: one pure builder per child kind, each returning a plain Kubernetes dict."""
