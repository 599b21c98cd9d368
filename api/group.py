"""The API group and version of the kuberl custom resources."""

GROUP = "kuberl.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
