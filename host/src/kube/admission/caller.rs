//! Who is writing: a node's agent, and then which node, or anyone else.
//!
//! An agent is known by its ServiceAccount, and its node by the pod its
//! token is bound to: the API server puts the pod's name and UID into the
//! user's extra fields when the token is a pod-bound one (a projected
//! `serviceAccountToken`), and the pod's `spec.nodeName` is the node. A
//! token of the agent's ServiceAccount that is not bound to a pod (a legacy
//! Secret token) names no node and may write nothing.

use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use std::collections::HashMap;
use std::sync::Mutex;

pub const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
pub const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";
/// Pods remembered (a pod's node never changes, and its UID is never reused).
const CACHED_PODS: usize = 4096;

/// The agents' ServiceAccount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentAccount {
    pub namespace: String,
    pub name: String,
}

impl AgentAccount {
    pub fn username(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }
}

impl std::str::FromStr for AgentAccount {
    type Err = String;
    /// `<namespace>/<name>`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('/') {
            Some((namespace, name))
                if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
            {
                Ok(AgentAccount { namespace: namespace.into(), name: name.into() })
            }
            _ => Err(format!("{s:?} is not <namespace>/<service-account>")),
        }
    }
}

pub struct Callers {
    client: kube::Client,
    agent: AgentAccount,
    username: String,
    nodes: Mutex<HashMap<String, String>>,
}

impl Callers {
    pub fn new(client: kube::Client, agent: AgentAccount) -> Callers {
        Callers { client, username: agent.username(), agent, nodes: Mutex::new(HashMap::new()) }
    }

    /// The node of the agent making a request as `user`; None when `user`
    /// is not the agents' ServiceAccount. An agent whose node cannot be
    /// told is refused with the reason.
    pub async fn node_of(&self, user: &UserInfo) -> Result<Option<String>, String> {
        if user.username.as_deref() != Some(self.username.as_str()) {
            return Ok(None);
        }
        let extra = |key: &str| {
            user.extra
                .as_ref()
                .and_then(|e| e.get(key))
                .and_then(|v| v.first())
                .filter(|v| !v.is_empty())
                .cloned()
        };
        let (Some(pod), Some(uid)) = (extra(POD_NAME_EXTRA), extra(POD_UID_EXTRA)) else {
            return Err(format!(
                "{} wrote with a token that is not bound to its pod, so its node is unknown: agents must use a projected serviceAccountToken (deploy/agent-daemonset.yaml)",
                self.username
            ));
        };
        if let Some(node) = self.nodes.lock().unwrap_or_else(|e| e.into_inner()).get(&uid) {
            return Ok(Some(node.clone()));
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.agent.namespace);
        let what = format!("the agent's pod {}/{pod}", self.agent.namespace);
        let found = api
            .get_opt(&pod)
            .await
            .map_err(|e| format!("cannot read {what}: {e}"))?
            .ok_or_else(|| format!("{what} does not exist"))?;
        if found.metadata.uid.as_deref() != Some(uid.as_str()) {
            return Err(format!("{what} is not the pod the token was bound to (UID {uid})"));
        }
        let node = found
            .spec
            .and_then(|s| s.node_name)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| format!("{what} is on no node"))?;
        let mut nodes = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        if nodes.len() >= CACHED_PODS {
            nodes.clear();
        }
        nodes.insert(uid, node.clone());
        Ok(Some(node))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_account_is_namespace_and_name() {
        let a: AgentAccount = "volagent-system/volagent-agent".parse().unwrap();
        assert_eq!(a.username(), "system:serviceaccount:volagent-system:volagent-agent");
        for bad in ["volagent-agent", "/x", "x/", "a/b/c"] {
            assert!(bad.parse::<AgentAccount>().is_err(), "{bad}");
        }
    }
}
