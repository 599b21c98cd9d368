"""Engine discovery: URL lists and EndpointSlices of a RolloutFleet's headless Service."""

import pytest
from kubernetes import client

from kuberl.rollout.discovery import (
    discover_fleet_urls,
    engines_from_urls,
    parse_url_list,
    urls_from_endpoint_slices,
)

RAW_SLICE = {  # as the API server returns it (camelCase)
    "apiVersion": "discovery.k8s.io/v1",
    "kind": "EndpointSlice",
    "metadata": {"name": "fleet-abc", "labels": {"kubernetes.io/service-name": "fleet"}},
    "addressType": "IPv4",
    "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 30000, "protocol": "TCP"}],
    "endpoints": [
        {"addresses": ["10.0.0.2"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.1"], "conditions": {}},  # unknown readiness counts as ready
        {"addresses": ["10.0.0.3"], "conditions": {"ready": False}},
        {"addresses": ["10.0.0.4"], "conditions": {"ready": True, "terminating": True}},
    ],
}


def test_urls_from_raw_and_client_slices():
    v6 = {"addressType": "IPv6", "ports": [{"name": "http", "port": 8080}],
          "endpoints": [{"addresses": ["fd00::5"], "conditions": {"ready": True}}]}  # fmt: skip
    no_port = {"addressType": "IPv4", "ports": [{"name": "grpc", "port": 1}],
               "endpoints": [{"addresses": ["10.9.9.9"]}]}  # fmt: skip
    assert urls_from_endpoint_slices([RAW_SLICE, v6, no_port, RAW_SLICE]) == [
        "http://10.0.0.1:30000",
        "http://10.0.0.2:30000",
        "http://[fd00::5]:8080",
    ]
    typed = client.V1EndpointSlice(
        address_type="IPv4",
        ports=[client.DiscoveryV1EndpointPort(name="http", port=30000)],
        endpoints=[
            client.V1Endpoint(addresses=["10.1.0.7"], conditions=client.V1EndpointConditions(ready=True)),
            client.V1Endpoint(addresses=["10.1.0.8"], conditions=client.V1EndpointConditions(ready=False)),
        ],
    )
    assert urls_from_endpoint_slices([typed.to_dict()]) == ["http://10.1.0.7:30000"]


def test_discover_uses_the_service_name_label():
    calls = []

    class FakeDiscoveryApi:
        def list_namespaced_endpoint_slice(self, namespace, label_selector):
            calls.append((namespace, label_selector))
            return client.V1EndpointSliceList(
                items=[
                    client.V1EndpointSlice(
                        address_type="IPv4",
                        ports=[client.DiscoveryV1EndpointPort(name="http", port=30000)],
                        endpoints=[client.V1Endpoint(addresses=["10.2.0.1"])],
                    )
                ]
            )

    assert discover_fleet_urls("qwen-fleet", "rl", api=FakeDiscoveryApi()) == ["http://10.2.0.1:30000"]
    assert calls == [("rl", "kubernetes.io/service-name=qwen-fleet")]


def test_url_lists():
    assert parse_url_list(" http://a:1/, http://b:2,,http://a:1") == ["http://a:1", "http://b:2"]
    engines = engines_from_urls(["http://a:1", "http://b:2"], retries=0)
    assert [e.name for e in engines] == ["a:1", "b:2"] and engines[0].retries == 0
    with pytest.raises(ValueError, match="must start with http"):
        parse_url_list("a:1")
    with pytest.raises(ValueError, match="no engine URLs"):
        parse_url_list(" , ")
