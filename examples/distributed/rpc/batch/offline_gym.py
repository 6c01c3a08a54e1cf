"""Offline stand-in for gymnasium's ``CartPole-v1`` (``gym.make('CartPole-v1')``), numpy only.

pytorch/examples' rpc/batch/reinforce.py imports gymnasium, which is not installed here. This is
gymnasium's CartPole physics (cartpole.py, MIT license: Euler steps of 0.02 s, force 10 N, the
pole failing past 12 degrees or the cart past 2.4) with v1's 500-step time limit; the observation,
reward, terminated/truncated and reset(seed=) follow gymnasium's API.
"""

import math

import numpy as np


class CartPole:
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    theta_threshold = 12 * 2 * math.pi / 360
    x_threshold = 2.4
    max_episode_steps = 500

    spec = type("EnvSpec", (), {"id": "CartPole-v1", "reward_threshold": 475.0,
                                 "max_episode_steps": 500})()

    def __init__(self):
        self.np_random = np.random.default_rng()
        self.state, self.steps = None, 0

    def reset(self, seed=None, options=None):
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
        self.state = self.np_random.uniform(-0.05, 0.05, size=4)
        self.steps = 0
        return self.state.astype(np.float32), {}

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if int(action) == 1 else -self.force_mag
        total_mass = self.masscart + self.masspole
        polemass_length = self.masspole * self.length
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + polemass_length * theta_dot ** 2 * sin) / total_mass
        theta_acc = (self.gravity * sin - cos * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * cos ** 2 / total_mass))
        x_acc = temp - polemass_length * theta_acc * cos / total_mass
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * x_acc
        theta, theta_dot = theta + self.tau * theta_dot, theta_dot + self.tau * theta_acc
        self.state = np.array([x, x_dot, theta, theta_dot])
        self.steps += 1
        terminated = bool(abs(x) > self.x_threshold or abs(theta) > self.theta_threshold)
        truncated = self.steps >= self.max_episode_steps
        return self.state.astype(np.float32), 1.0, terminated, truncated, {}


def make(name):
    if name != "CartPole-v1":
        raise ValueError(f"offline_gym has CartPole-v1 only, got {name!r}")
    return CartPole()
