//! What the 0.x contracts share: every call is one export of their
//! `policy` interface, taking and returning records, and their `host`
//! queries are the same. Each version's module expands these with its own
//! bindings (`bindings`, and `a` for their types) in scope.

/// `info`, `fence`, `attach`, `detach` and `cleanup` of `Guest`, for the
/// bindings' `Backend`.
macro_rules! record_calls {
    () => {
        fn info(&self, s: &mut Store<CallState>) -> wasmtime::Result<m::BackendInfo> {
            Ok(self.volagent_policy_policy().call_info(s)?.up())
        }

        fn fence(
            &self,
            s: &mut Store<CallState>,
            volume: &m::Volume,
            requester: &m::Consumer,
            holders: &[m::Holder],
            nodes: &[m::NodeFacts],
        ) -> Answer<m::Decision> {
            let (h, n): (Vec<a::Holder>, Vec<a::NodeFacts>) = (holders.down(), nodes.down());
            let r = self.volagent_policy_policy().call_fence(
                s,
                &volume.down(),
                &requester.down(),
                &h,
                &n,
            )?;
            Ok(r.up())
        }

        fn attach(
            &self,
            s: &mut Store<CallState>,
            volume: &m::Volume,
            requester: &m::Consumer,
            local_holders: &[m::Holder],
            paths: &m::NodePaths,
        ) -> Answer<m::Plan> {
            let h: Vec<a::Holder> = local_holders.down();
            let r = self.volagent_policy_policy().call_attach(
                s,
                &volume.down(),
                &requester.down(),
                &h,
                &paths.down(),
            )?;
            Ok(r.up())
        }

        fn detach(
            &self,
            s: &mut Store<CallState>,
            volume: &m::Volume,
            consumer: &m::Consumer,
            local_holders: &[m::Holder],
            paths: &m::NodePaths,
        ) -> Answer<m::Plan> {
            let h: Vec<a::Holder> = local_holders.down();
            let r = self.volagent_policy_policy().call_detach(
                s,
                &volume.down(),
                &consumer.down(),
                &h,
                &paths.down(),
            )?;
            Ok(r.up())
        }

        fn cleanup(
            &self,
            s: &mut Store<CallState>,
            reason: m::CleanupReason,
            items: &[m::CleanupItem],
        ) -> Answer<m::Plan> {
            let i: Vec<a::CleanupItem> = items.down();
            Ok(self.volagent_policy_policy().call_cleanup(s, reason.down(), &i)?.up())
        }
    };
}

/// The `host` imports, for the call state.
macro_rules! record_host {
    () => {
        impl a::Host for CallState {}

        impl bindings::volagent::policy::host::Host for CallState {
            fn log(&mut self, level: a::LogLevel, message: String) -> wasmtime::Result<()> {
                self.guest_log(level.up(), message);
                Ok(())
            }

            fn node_state(&mut self, name: String) -> wasmtime::Result<a::NodeFacts> {
                Ok(self.queries().node_state(&name).down())
            }

            // A query the host will not answer fails the guest's call (a trap
            // carrying the QueryError): no answer the contract has would be true.
            fn lookup_path(&mut self, path: String) -> wasmtime::Result<a::PathKind> {
                Ok(self.queries().lookup_path(&path)?.down())
            }

            fn filesystem_type(&mut self, device: String) -> wasmtime::Result<Option<String>> {
                Ok(self.queries().filesystem_type(&device)?)
            }

            fn mount_at(&mut self, target: String) -> wasmtime::Result<Option<a::MountEntry>> {
                Ok(self.queries().mount_at(&target)?.down())
            }

            fn image_watchers(
                &mut self,
                pool: String,
                image: String,
            ) -> wasmtime::Result<Result<Vec<a::Watcher>, String>> {
                Ok(self.queries().image_watchers(&pool, &image).map(|w| w.down()))
            }
        }
    };
}

pub(crate) use {record_calls, record_host};
