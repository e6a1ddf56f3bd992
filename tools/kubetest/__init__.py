"""Test infrastructure for the Kubernetes platform: a real control plane on
127.0.0.1 (`KubeCluster`, binaries from scripts/kube_env.sh) and a kubelet
that runs Pods as local processes, each a machine of its own on a private
network (`TestKubelet`, `PodNetwork`). No mock of the API."""

from __future__ import annotations

from kubetest.cluster import (
    KubeBinaries,
    KubeCluster,
    KubeClusterError,
    KubeEnvMissing,
    WaitTimeout,
    wait_until,
)
from kubetest.kubelet import ContainerResources, KubeletError, PodRef, TestKubelet
from kubetest.network import NetworkError, PodNetwork

__all__ = [
    "ContainerResources",
    "KubeBinaries",
    "KubeCluster",
    "KubeClusterError",
    "KubeEnvMissing",
    "KubeletError",
    "NetworkError",
    "PodNetwork",
    "PodRef",
    "TestKubelet",
    "WaitTimeout",
    "wait_until",
]
