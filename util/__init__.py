"""kuberl.util: small utilities every component may use, importing nothing else of kuberl.

``envvars`` -- numbers read from environment variables; ``lifetime`` -- the processes kuberl
starts end with the process that started them; ``ports`` -- a free TCP port for a server that
binds it later.
"""
