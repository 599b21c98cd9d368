"""kuberl's Grafana dashboards as code: ``definitions`` (the dashboards), ``metrics_catalog``
(every metric they may query) and ``cli`` (``kuberl dashboards generate|upload``)."""
