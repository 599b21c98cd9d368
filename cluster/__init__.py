"""A local Kubernetes control plane made of the real programs, for ``kuberl cluster`` and the tests.

Modules: ``build`` (the programs, built from their Go modules at pinned versions and cached),
``pki`` (CA, serving and client certificates, service-account key), ``nodes`` (kwok's simulated
MI300X, H100 and CPU nodes), ``control_plane`` (start, wait, stop; kubeconfigs), ``errors``; the real node: ``node`` (start,
stop), ``node_config`` (its configuration files), ``containerd``, ``pause_image``, ``host_state``
(what it changes on the host, recorded and undone).
"""
