pub struct Containerd;
