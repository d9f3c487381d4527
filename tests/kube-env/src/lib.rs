//! Placeholder: a real etcd + kube-apiserver for tests (being written).
