//! `deploy/` against a real kube-apiserver (1.20.2, from `tests/kube-env`).
//!
//! The files `deploy/kustomization.yaml` lists are applied in its order with
//! server-side apply, as `kubectl apply -k deploy/` would create them: the
//! namespace, CRDs and RBAC for real, the workloads (DaemonSet, Deployment)
//! as dry runs, since nothing here would run their pods. The API server must
//! keep every field the files set (a misspelt or misplaced field fails), and
//! a pod from each workload's template must pass pod admission. Then the RBAC
//! the files created is checked by acting as each service account: the calls
//! it needs succeed, others are forbidden, and an access review of a fixed
//! set of resources and verbs finds exactly the grants issue 4 specifies.
//!
//! The tests that need the API server fail (they do not skip) when its
//! binaries are missing: run `scripts/kube-assets`.

mod access;
mod apply;
mod kustomization;
mod manifests;
mod rbac;
mod webhook;
mod workloads;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use access::*;
use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Event, Namespace, Node, ObjectReference, PersistentVolume, PodSpec,
    Secret,
};
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams, PostParams,
};
use kube::core::GroupVersionKind;
use kube::discovery::{ApiResource, Discovery, Scope};
use manifests::*;
use serde::Deserialize;
use serde_json::{Value, json};
use volagent_kube_env::KubeEnv;
use volagent_test_support::{kube_objects, shipped};

const NAMESPACE: &str = "volagent-system";
/// The controller's own namespace: its Lease, webhook certificate and the
/// credentials no node may read.
const CONTROLLER_NS: &str = "volagent-controller";
const AGENT_SA: &str = "volagent-agent";
const CONTROLLER_SA: &str = "volagent-controller";
const LEASE: &str = "volagent-controller";
const WEBHOOK: &str = "volagent-node-restriction";
const WEBHOOK_TLS: &str = "volagent-admission-tls";
const FIELD_MANAGER: &str = "volagent-deploy-test";
/// Applied as dry runs: their pods would need nodes, images and a kubelet.
const WORKLOAD_KINDS: [&str; 2] = ["DaemonSet", "Deployment"];
