//! Starts a real node (its own control plane, kube-controller-manager, kube-scheduler,
//! containerd with Multus and whereabouts, a kubelet) for a person, and prints how to use it.
//! Ctrl-C stops it and puts the host back.

fn main() -> anyhow::Result<()> {
    let ctrl_c = testenv::procs::CtrlC::block();
    let node = testenv::Node::start()?;
    println!("node {} is Ready", testenv::node::NODE_NAME);
    println!("logs and state: {}", node.dir().display());
    println!("control plane: {}", node.cp.dir().display());
    println!("CRI socket: {}", node.cri_socket().display());
    println!(
        "whereabouts configuration_path: {}",
        node.whereabouts_conf().display()
    );
    println!();
    println!(
        "  export KUBECONFIG={}",
        node.cp.kubeconfig_path().display()
    );
    println!("  kubectl get nodes");
    println!();
    println!("Press Ctrl-C to stop it.");
    ctrl_c.wait();
    node.stop()
}
